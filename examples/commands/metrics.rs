//! `GET /metrics` (with `--features metrics`): the idempotency layer's metrics in
//! Prometheus text, from `metrics-exporter-prometheus` installed as the `metrics`
//! recorder at start.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder (once) and describes the layer's metrics.
pub(crate) fn install() {
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .install_recorder()
            .expect("the only metrics recorder of the process");
        tower_ids::idempotency::metrics::describe();
        handle
    });
}

/// `GET /metrics`: every metric recorded so far, in Prometheus' text format.
pub(crate) async fn render() -> String {
    HANDLE
        .get()
        .map(PrometheusHandle::render)
        .unwrap_or_default()
}
