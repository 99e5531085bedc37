//! Payments from a RabbitMQ queue: manual acks, a prefetch of deliveries handled at
//! once, each acked only once the inbox has committed (or replayed) it.

use futures_util::StreamExt as _;
use lapin::{
    message::Delivery,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
        BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
        QueueDeclareOptions,
    },
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::{acknowledge, handle, shutdown, Consumer, Delivered, Next, Payment};

#[derive(clap::Args, Debug)]
pub(crate) struct AmqpArgs {
    /// The RabbitMQ broker (`--broker amqp`).
    #[arg(
        long,
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The queue the payments are published to and consumed from (durable).
    #[arg(long, global = true, default_value = "inbox.payments")]
    queue: String,
    /// Deliveries handled at once (the channel's prefetch).
    #[arg(long, global = true, default_value_t = 8)]
    pub(crate) prefetch: u16,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn channel(args: &AmqpArgs) -> Result<(Connection, Channel), Error> {
    let connection = Connection::connect(&args.amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            args.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((connection, channel))
}

/// Publishes each payment, persistent and confirmed by the broker, with a `message_id`
/// of its own (a payment sent twice is two messages with one idempotency key).
pub(crate) async fn publish(args: &AmqpArgs, payments: &[&Payment]) -> Result<(), Error> {
    let (connection, channel) = channel(args).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for payment in payments {
        let body = serde_json::to_vec(payment)?;
        let message_id = uuid::Uuid::now_v7().to_string();
        channel
            .basic_publish(
                "".into(),
                args.queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2)
                    .with_message_id(message_id.as_str().into()),
            )
            .await?
            .await?;
    }
    let _ = connection.close(200, "published".into()).await;
    Ok(())
}

/// Consumes the queue until Ctrl-C or SIGTERM: each delivery in a task of its own, at
/// most `prefetch` at once. On a stop, no new deliveries; those in flight are handled
/// and acked, the rest go back to the queue when the connection closes.
pub(crate) async fn consume(args: &AmqpArgs, consumer: Consumer) -> Result<(), Error> {
    let (connection, channel) = channel(args).await?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            args.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(), // manual acks
            FieldTable::default(),
        )
        .await?;
    tracing::info!(event = "inbox.ready", broker = "amqp", queue = %args.queue, prefetch = args.prefetch, "consuming");

    let mut handling = JoinSet::new();
    let stop = shutdown::signal();
    tokio::pin!(stop);
    let signal = loop {
        let delivery = tokio::select! {
            delivery = deliveries.next() => delivery,
            Some(_) = handling.join_next() => continue,
            signal = &mut stop => break Some(signal),
        };
        let Some(delivery) = delivery else { break None };
        let delivery = delivery?;
        let mut inbox = consumer.inbox.clone();
        let ack_delay = consumer.ack_delay;
        let id = match delivery.properties.message_id() {
            Some(id) => id.to_string(),
            None => format!("tag-{}", delivery.delivery_tag),
        };
        let span = tracing::info_span!("delivery", delivery = %id);
        handling.spawn(
            async move {
                let Ok(payment) = serde_json::from_slice::<Payment>(&delivery.data) else {
                    tracing::warn!(event = "inbox.rejected", delivery = %id, reason = "not_a_payment", "not a payment; rejected");
                    let _ = delivery.reject(BasicRejectOptions { requeue: false }).await;
                    return;
                };
                tracing::info!(
                    event = "inbox.received",
                    delivery = %id,
                    key = %payment.idempotency_key,
                    redelivered = delivery.redelivered,
                    "payment received"
                );
                let delivered = Delivered {
                    payment,
                    delivery: id.clone(),
                };
                match handle(&mut inbox, delivered).await {
                    Next::Ack => {
                        let ack = async { delivery.ack(BasicAckOptions::default()).await.map(drop) };
                        acknowledge(ack_delay, &id, ack).await;
                    }
                    Next::Retry(after) => requeue(&delivery, after).await,
                    Next::Reject => {
                        let _ = delivery.reject(BasicRejectOptions { requeue: false }).await;
                    }
                }
            }
            .instrument(span),
        );
    };
    tracing::info!(
        event = "inbox.stopping",
        signal,
        in_flight = handling.len(),
        "stopping: no new deliveries, finishing those in flight"
    );
    let _ = channel
        .basic_cancel(deliveries.tag(), BasicCancelOptions::default())
        .await;
    while handling.join_next().await.is_some() {}
    shutdown::drain(&[consumer.drain], consumer.drain_timeout).await;
    // Deliveries prefetched but never started go back to the queue now.
    let _ = connection.close(200, "stopped".into()).await;
    tracing::info!(event = "inbox.stopped", "stopped");
    Ok(())
}

/// Holds the delivery for `after`, then gives it back to the queue.
async fn requeue(delivery: &Delivery, after: std::time::Duration) {
    tokio::time::sleep(after).await;
    let _ = delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await;
}
