//! The store's way to Redis: one node, or a cluster whose client follows its topology
//! (MOVED, ASK, failovers) by itself; and, optionally, replicas' acknowledgement of a
//! write (`WAIT`) on the same connection as the write, a connection no other command
//! shares meanwhile ([`WaitConnections`]).

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{
        MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
    },
    Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value,
};

use super::scripts::StoreScript;
use tower_ids_core::store::StoreError;

/// The longest pause between two attempts to reconnect: 50 ms. After an outage a
/// claim outlives only if a renewal lands soon after Redis accepts connections again,
/// so the client must not be sleeping then; an attempt on a server that is down is
/// refused at once and costs next to nothing.
pub(super) const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(50);

/// The first pause before reconnecting, doubled up to [`RECONNECT_MAX_DELAY`].
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(10);

/// A connection to one Redis node (reconnecting by itself) or to a cluster.
#[derive(Clone)]
pub(super) enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Node(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Node(connection) => connection.req_packed_commands(cmd, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

impl Connection {
    /// Connects to the node at `url`, within `timeout`; answers are awaited for
    /// `answer_within`.
    pub(super) async fn node(
        url: &str,
        timeout: Duration,
        answer_within: Duration,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::with_source("invalid Redis URL", e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(answer_within))
            .set_min_delay(RECONNECT_MIN_DELAY)
            .set_max_delay(RECONNECT_MAX_DELAY);
        let connection = tokio::time::timeout(
            timeout * 4,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| StoreError::new("timed out connecting to Redis"))?
        .map_err(|e| StoreError::with_source("could not connect to Redis", e))?;
        Ok(Self::Node(connection))
    }

    /// Connects to the cluster that `seeds` belong to, within `timeout`; answers are
    /// awaited for `answer_within`.
    pub(super) async fn cluster(
        seeds: &[String],
        timeout: Duration,
        answer_within: Duration,
    ) -> Result<Self, StoreError> {
        let client = ClusterClient::builder(seeds.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(answer_within)
            // A failover takes seconds: the store's own timeout, not the client's
            // retries, decides how long a request waits for it.
            .retries(2)
            // And between its retries, as a single node's reconnects.
            .min_retry_wait(millis(RECONNECT_MIN_DELAY))
            .max_retry_wait(millis(RECONNECT_MAX_DELAY))
            .build()
            .map_err(|e| StoreError::with_source("invalid Redis Cluster seed URLs", e))?;
        let connection = tokio::time::timeout(timeout * 4, client.get_async_connection())
            .await
            .map_err(|_| StoreError::new("timed out connecting to Redis Cluster"))?
            .map_err(|e| StoreError::with_source("could not connect to Redis Cluster", e))?;
        Ok(Self::Cluster(connection))
    }

    /// Redis's clock, in microseconds since the Unix epoch. On a cluster, the earliest
    /// of its primaries' clocks: the deadline then bounds the node whose clock is
    /// furthest behind, and so every node.
    pub(super) async fn time(self) -> Result<i64, StoreError> {
        let failed = |e| StoreError::with_source("reading Redis's clock", e);
        let value = match self {
            Self::Node(mut connection) => redis::cmd("TIME")
                .query_async::<Value>(&mut connection)
                .await
                .map_err(failed)?,
            Self::Cluster(mut connection) => connection
                .route_command(
                    redis::cmd("TIME"),
                    RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
                )
                .await
                .map_err(failed)?,
        };
        let mut times = Vec::new();
        collect_times(&value, &mut times);
        times
            .into_iter()
            .min()
            .ok_or_else(|| StoreError::new("reading Redis's clock: TIME answered nothing"))
    }

    /// Runs `call` of `script` and, with `wait`, waits for replicas to acknowledge it
    /// (`WAIT` pipelined behind it, so on the connection that wrote); returns its
    /// answer and how many replicas acknowledged. A server that does not know the
    /// script yet (`NOSCRIPT`: a fresh node, a promoted replica) is sent it, and the
    /// answer is `None`: call again, with a deadline of its own (loading took part of
    /// this one's).
    pub(super) async fn run<T: FromRedisValue>(
        mut self,
        script: &StoreScript,
        call: Cmd,
        wait: Option<Wait>,
    ) -> RedisResult<Option<(T, Option<u64>)>> {
        let answer = match wait {
            None => call
                .query_async::<T>(&mut self)
                .await
                .map(|value| (value, None)),
            Some(wait) => {
                let mut pipe = redis::pipe();
                pipe.add_command(call.clone())
                    .cmd("WAIT")
                    .arg(wait.replicas)
                    .arg(
                        u64::try_from(wait.timeout.as_millis())
                            .unwrap_or(u64::MAX)
                            .max(1),
                    );
                pipe.query_async::<(T, u64)>(&mut self)
                    .await
                    .map(|(value, acknowledged)| (value, Some(acknowledged)))
            }
        };
        match answer {
            Err(error) if error.code() == Some("NOSCRIPT") => {
                self.load(script, &call).await?;
                Ok(None)
            }
            answer => answer.map(Some),
        }
    }
}

impl Connection {
    /// Loads `script`. On a cluster, on every node, so a replica promoted later has it
    /// already; if a node cannot take it (down, which is when a replica gets
    /// promoted), on the primary of `call`'s slot only, which is where `call` goes.
    async fn load(&mut self, script: &StoreScript, call: &Cmd) -> RedisResult<()> {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(script.source());
        let everywhere = load.query_async::<Value>(&mut *self).await;
        let Self::Cluster(connection) = self else {
            return everywhere.map(drop);
        };
        if everywhere.is_ok() {
            return Ok(());
        }
        // `EVALSHA digest numkeys key ...`: the first key (the fourth word) names the
        // slot.
        let Some(redis::Arg::Simple(key)) = call.args_iter().nth(3) else {
            return everywhere.map(drop);
        };
        let route = Route::with_key(key, SlotAddr::Master);
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
        connection.route_command(load, routing).await.map(drop)
    }
}

/// The most connections that [`WaitConnections`] keeps between calls: as many as calls
/// that wait for replicas usually run at once, so a steady load makes none.
const IDLE_WAIT_CONNECTIONS: usize = 8;

/// The most connections that [`WaitConnections`] lends at once. Past it, a call waits
/// for replicas on the store's shared connection, as if there were no pool: a burst
/// that large makes no more connections (on a cluster, one per node each).
const MAX_WAIT_CONNECTIONS: usize = 64;

/// Connections lent, one call at a time, to the calls that wait for replicas.
///
/// Redis's `WAIT` blocks the connection it is sent on until the replicas acknowledge the
/// write or its timeout passes, and every command sent behind it on that connection
/// waits too. On the store's one multiplexed connection per node, a primary that has
/// lost its replica (a failover whose old primary does not come back, a replica in a
/// full resynchronisation) held each command behind every `WAIT` for the whole replicas'
/// wait, past its deadline: every claim, renewal, completion and replay on that node was
/// refused as late or timed out, and a replica keeping an outcome never got it stored
/// (its duplicates answered `409` until a replica came back, while the claim ran out).
/// A connection of its own per call keeps a `WAIT` from delaying anything but its call.
///
/// A connection is given back only after an answer; one whose call timed out or broke
/// (its `WAIT` may still be blocking it) is dropped, which closes it.
pub(super) struct WaitConnections {
    make: Make,
    lent: Mutex<Lending>,
    /// Lent instead, past [`MAX_WAIT_CONNECTIONS`].
    shared: Connection,
}

#[derive(Default)]
struct Lending {
    idle: Vec<Connection>,
    /// Connections lent now, of the pool's own.
    out: usize,
}

/// How to make one more connection like the store's.
enum Make {
    Node {
        url: String,
        timeout: Duration,
        answer_within: Duration,
    },
    Cluster {
        seeds: Vec<String>,
        timeout: Duration,
        answer_within: Duration,
    },
}

impl WaitConnections {
    /// A pool of connections to the node at `url`, as [`Connection::node`] makes them.
    pub(super) fn node(
        url: &str,
        timeout: Duration,
        answer_within: Duration,
        shared: Connection,
    ) -> Self {
        Self::new(
            Make::Node {
                url: url.to_owned(),
                timeout,
                answer_within,
            },
            shared,
        )
    }

    /// A pool of connections to the cluster of `seeds`, as [`Connection::cluster`]
    /// makes them.
    pub(super) fn cluster(
        seeds: &[String],
        timeout: Duration,
        answer_within: Duration,
        shared: Connection,
    ) -> Self {
        Self::new(
            Make::Cluster {
                seeds: seeds.to_vec(),
                timeout,
                answer_within,
            },
            shared,
        )
    }

    fn new(make: Make, shared: Connection) -> Self {
        Self {
            make,
            lent: Mutex::default(),
            shared,
        }
    }

    /// Makes one connection to lend, so that the first call waiting for replicas does
    /// not connect first.
    pub(super) async fn open_one(&self) -> Result<(), StoreError> {
        let connection = self
            .make()
            .await
            .map_err(|e| StoreError::with_source("could not connect to Redis", e))?;
        self.lending().idle.push(connection);
        Ok(())
    }

    fn lending(&self) -> std::sync::MutexGuard<'_, Lending> {
        self.lent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Connection::run`] on a connection no other call uses meanwhile.
    pub(super) async fn run<T: FromRedisValue>(
        self: &Arc<Self>,
        script: &StoreScript,
        call: Cmd,
        wait: Option<Wait>,
    ) -> RedisResult<Option<(T, Option<u64>)>> {
        let lent = self.lend().await?;
        let answer = lent.connection.clone().run(script, call, wait).await;
        match &answer {
            // Redis answered: nothing is left waiting on the connection.
            Ok(_) => lent.give_back(),
            Err(error) if !(error.is_io_error() || error.is_unrecoverable_error()) => {
                lent.give_back();
            }
            // Dropped with `lent`: a `WAIT` may still hold it.
            Err(_) => {}
        }
        answer
    }

    /// An idle connection, or a new one; the shared one past [`MAX_WAIT_CONNECTIONS`].
    async fn lend(self: &Arc<Self>) -> RedisResult<Lent> {
        let idle = {
            let mut lending = self.lending();
            if lending.idle.is_empty() && lending.out >= MAX_WAIT_CONNECTIONS {
                return Ok(Lent {
                    connection: self.shared.clone(),
                    pool: None,
                });
            }
            lending.out += 1;
            lending.idle.pop()
        };
        // Counted from here: a connection that fails to be made, or whose call is
        // dropped, is uncounted by `Lent`'s drop.
        let mut lent = Lent {
            connection: self.shared.clone(),
            pool: Some(self.clone()),
        };
        lent.connection = match idle {
            Some(connection) => connection,
            None => self.make().await?,
        };
        Ok(lent)
    }

    async fn make(&self) -> RedisResult<Connection> {
        let made = match &self.make {
            Make::Node {
                url,
                timeout,
                answer_within,
            } => Connection::node(url, *timeout, *answer_within).await,
            Make::Cluster {
                seeds,
                timeout,
                answer_within,
            } => Connection::cluster(seeds, *timeout, *answer_within).await,
        };
        made.map_err(|error| {
            redis::RedisError::from((
                redis::ErrorKind::Io,
                "connecting for a call that waits for replicas",
                error.to_string(),
            ))
        })
    }
}

/// A connection lent by [`WaitConnections`], or the shared one.
struct Lent {
    connection: Connection,
    /// The pool it is counted in, if it is the pool's own.
    pool: Option<Arc<WaitConnections>>,
}

impl Lent {
    fn give_back(mut self) {
        if let Some(pool) = self.pool.take() {
            let mut lending = pool.lending();
            lending.out -= 1;
            if lending.idle.len() < IDLE_WAIT_CONNECTIONS {
                lending.idle.push(self.connection.clone());
            }
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.lending().out -= 1;
        }
    }
}

/// How many replicas must acknowledge a claim or a completion, and how long to wait.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Every `TIME` answer (two integers) in `value`, as microseconds.
fn collect_times(value: &Value, times: &mut Vec<i64>) {
    let integer = |value: &Value| -> Option<i64> {
        match value {
            Value::Int(n) => Some(*n),
            Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
            Value::SimpleString(text) => text.parse().ok(),
            _ => None,
        }
    };
    match value {
        Value::Array(items) | Value::Set(items) => {
            if let [seconds, micros] = items.as_slice() {
                if let (Some(seconds), Some(micros)) = (integer(seconds), integer(micros)) {
                    times.push(seconds.saturating_mul(1_000_000).saturating_add(micros));
                    return;
                }
            }
            items.iter().for_each(|item| collect_times(item, times));
        }
        Value::Map(pairs) => pairs
            .iter()
            .for_each(|(_, item)| collect_times(item, times)),
        _ => {}
    }
}
