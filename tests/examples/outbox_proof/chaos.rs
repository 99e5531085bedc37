//! The relays and the consumers as a fleet: started, SIGKILLed at random points of the
//! progress and started again, restarted when they exit by themselves, the broker
//! disturbed once halfway ([`Fault`]), and all stopped with SIGTERM at the end.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::{
    amqp, kafka,
    processes::{Process, Progress, Role, Run},
    KILLS, MESSAGES, RELAYS,
};

/// The disturbance of the broker, once, halfway.
#[derive(Clone)]
pub(crate) enum Fault {
    /// `rabbitmqctl close_all_connections`, in the vhost if there is one.
    CloseConnections { vhost: Option<String> },
    /// SIGSTOP, [`PAUSE`](crate::PAUSE), SIGCONT.
    Pause { pid: u32 },
    /// No way to disturb this broker here (said loudly).
    None,
}

/// How the relays and the consumers are started.
pub(crate) struct Fleet {
    /// `examples/outbox relay` arguments, without `--instance`.
    pub(crate) relay: Vec<String>,
    /// `examples/inbox consume` arguments of each consumer, without `--instance`.
    pub(crate) consumers: Vec<Vec<String>>,
    pub(crate) fault: Fault,
}

/// What the chaos did.
#[derive(Default)]
pub(crate) struct Chaos {
    pub(crate) runs: Vec<Run>,
    pub(crate) relay_kills: usize,
    pub(crate) consumer_kills: usize,
    /// Processes that exited by themselves and were started again: (role, status).
    pub(crate) exits: Vec<(Role, String)>,
    /// What the fault did, in words, and at which handled count.
    pub(crate) fault: Option<String>,
}

/// `count` thresholds, one drawn uniformly in each of `count` equal slices of 5% to
/// 90% of `total`: random, and spread over the run.
fn thresholds(count: usize, total: usize) -> Vec<usize> {
    let (from, to) = (total / 20, total * 9 / 10);
    let width = (to - from) / count;
    (0..count)
        .map(|n| from + n * width + rand::random_range(0..width))
        .collect()
}

/// Starts the relays and the consumers, tells `ready`, then kills and restarts them at
/// the planned points and restarts any that exits, until `stop`; then stops them all
/// with SIGTERM.
pub(crate) fn chaos(
    fleet: Fleet,
    progress: Arc<Progress>,
    ready: std::sync::mpsc::Sender<()>,
    stop: Arc<AtomicBool>,
) -> Chaos {
    let mut report = Chaos::default();
    let start = |role: Role, slot: usize, generation: usize| {
        let (example, base, prefix) = match role {
            Role::Relay => ("outbox", &fleet.relay, "relay"),
            Role::Consumer => ("inbox", &fleet.consumers[slot], "consumer"),
        };
        let name = format!("{prefix}-{slot}-{generation}");
        let mut args = base.clone();
        args.extend(["--instance".to_owned(), name.clone()]);
        Process::start(example, role, name, &args, progress.clone())
    };
    let mut relays: Vec<(Option<Process>, usize)> = (0..RELAYS)
        .map(|slot| (Some(start(Role::Relay, slot, 0)), 0))
        .collect();
    let mut consumers: Vec<(Option<Process>, usize)> = (0..fleet.consumers.len())
        .map(|slot| (Some(start(Role::Consumer, slot, 0)), 0))
        .collect();
    ready.send(()).unwrap();

    let mut relay_points = thresholds(KILLS, MESSAGES).into_iter().peekable();
    let mut consumer_points = thresholds(KILLS, MESSAGES).into_iter().peekable();
    let fault_at = MESSAGES * 2 / 5 + rand::random_range(0..MESSAGES / 5);
    let mut fault: Option<JoinHandle<String>> = None;
    let faulting = Arc::new(AtomicBool::new(false));

    while !stop.load(Ordering::Relaxed) {
        // Whoever exited by itself starts again.
        for (role, slots) in [(Role::Relay, &mut relays), (Role::Consumer, &mut consumers)] {
            for (slot, (process, generation)) in slots.iter_mut().enumerate() {
                let status = process.as_mut().unwrap().exited();
                if let Some(status) = status {
                    let run = process.take().unwrap().finish(role);
                    report.runs.push(run);
                    report.exits.push((role, status.to_string()));
                    *generation += 1;
                    *process = Some(start(role, slot, *generation));
                }
            }
        }
        let published = progress.published.load(Ordering::Relaxed);
        let handled = progress.handled.load(Ordering::Relaxed);
        // Kills wait while the broker is disturbed (each fault on its own), and for a
        // victim that exited by itself to be started again.
        if !faulting.load(Ordering::Relaxed) {
            if relay_points.peek().is_some_and(|point| published >= *point) {
                let slot = rand::random_range(0..relays.len());
                let (process, generation) = &mut relays[slot];
                if process.as_mut().unwrap().exited().is_none() {
                    relay_points.next();
                    report.runs.push(process.take().unwrap().kill_mid_round());
                    report.relay_kills += 1;
                    *generation += 1;
                    *process = Some(start(Role::Relay, slot, *generation));
                }
            }
            if consumer_points
                .peek()
                .is_some_and(|point| handled >= *point)
            {
                let slot = rand::random_range(0..consumers.len());
                let (process, generation) = &mut consumers[slot];
                if process.as_mut().unwrap().exited().is_none() {
                    consumer_points.next();
                    report
                        .runs
                        .push(process.take().unwrap().kill(Role::Consumer));
                    report.consumer_kills += 1;
                    *generation += 1;
                    *process = Some(start(Role::Consumer, slot, *generation));
                }
            }
        }
        if fault.is_none() && handled >= fault_at {
            let kind = fleet.fault.clone();
            let faulting = faulting.clone();
            faulting.store(true, Ordering::Relaxed);
            fault = Some(std::thread::spawn(move || {
                let what = disturb(&kind);
                // A second for the processes it brought down to exit and start again.
                std::thread::sleep(Duration::from_secs(1));
                faulting.store(false, Ordering::Relaxed);
                format!("{what}, at {handled} payments applied")
            }));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some(fault) = fault {
        report.fault = Some(fault.join().expect("the fault thread"));
    }
    assert!(
        relay_points.peek().is_none() && consumer_points.peek().is_none(),
        "the run ended before its kills: {} relay and {} consumer kills of {KILLS} each",
        report.relay_kills,
        report.consumer_kills
    );
    for (role, slots) in [(Role::Relay, relays), (Role::Consumer, consumers)] {
        for (process, _) in slots {
            report.runs.push(process.unwrap().terminate(role));
        }
    }
    report
}
/// Disturbs the broker once; says what it did.
fn disturb(fault: &Fault) -> String {
    match fault {
        Fault::CloseConnections { vhost } => amqp::close_connections(vhost.as_deref()),
        Fault::Pause { pid } => kafka::pause(*pid),
        Fault::None => "no fault (this broker cannot be disturbed here)".to_owned(),
    }
}
