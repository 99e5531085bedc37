//! [`PostgresStore`]'s [`IdempotencyStore`] commands (claim, renew, complete, release,
//! wait), and the column values they bind.

use std::{sync::Arc, time::Duration};

use sqlx::Row;

use super::{transaction, PostgresMode, PostgresStore};
use tower_ids_core::{
    store::{
        codec::{decode_record, encode_record, from_millis, millis},
        sent_claim::SentClaim,
        Begin, Claim, Completion, IdempotencyStore, Lease, Payload, Record, Renewal, StoreError,
        Waited,
    },
    Fingerprint, ScopeKey,
};

pub(super) fn token_bytes(lease: &Lease) -> [u8; 16] {
    lease.token.to_be_bytes()
}

pub(super) fn millis_i64(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

pub(super) fn epoch_i64(epoch: Option<u64>) -> Option<i64> {
    epoch.map(|e| i64::try_from(e).unwrap_or(i64::MAX))
}

/// The `status` column, for operators: the outcome's [`status`](Payload::status) (the
/// HTTP status, the gRPC code, `0` for a message outcome), `NULL` for an outcome too
/// large to keep.
pub(super) fn status_i16(record: &Record) -> Option<i16> {
    let status = record.payload.as_ref().map(Payload::status)?;
    Some(i16::try_from(status).unwrap_or(i16::MAX))
}

pub(super) fn first_seen_ms(lease: &Lease) -> i64 {
    i64::try_from(millis(lease.first_seen)).unwrap_or(i64::MAX)
}

/// A live row of the table (`completed`, `record`, `request_count`, `fingerprint`,
/// `first_seen_ms`, `epoch`): its record, or the claim of the request in flight.
pub(super) fn live_row(row: &sqlx::postgres::PgRow) -> Result<Begin, StoreError> {
    let corrupt = |e| StoreError::with_source("corrupt row in PostgreSQL", e);
    let request_count: i64 = row.try_get("request_count").map_err(corrupt)?;
    let request_count = u64::try_from(request_count).unwrap_or(0);
    if row.try_get::<bool, _>("completed").map_err(corrupt)? {
        let record: Vec<u8> = row.try_get("record").map_err(corrupt)?;
        return Ok(Begin::Completed {
            record: Arc::new(decode_record(&record)?),
            request_count,
        });
    }
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(corrupt)?;
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| StoreError::new("corrupt row in PostgreSQL: fingerprint"))?;
    let first_seen: i64 = row.try_get("first_seen_ms").map_err(corrupt)?;
    let epoch: Option<i64> = row.try_get("epoch").map_err(corrupt)?;
    Ok(Begin::InFlight {
        fingerprint: Fingerprint::from_bytes(fingerprint),
        first_seen: from_millis(u64::try_from(first_seen).unwrap_or(0)),
        epoch: epoch.map(|e| u64::try_from(e).unwrap_or(0)),
        request_count,
    })
}

impl IdempotencyStore for PostgresStore {
    fn recovery_time(&self) -> Duration {
        match self.mode {
            // The pool opens a connection on demand, within the command's own bound.
            PostgresMode::Durable => self.shared.timeout,
            // No lease is ever renewed: the transaction holds the key.
            PostgresMode::Transactional => Duration::ZERO,
        }
    }

    async fn begin(&self, scope: &ScopeKey, claim: Claim) -> Result<Begin, StoreError> {
        if self.mode == PostgresMode::Transactional {
            return transaction::claim(&self.shared, scope).await;
        }
        let lease = Lease::new(rand::random(), std::time::SystemTime::now());
        let token = token_bytes(&lease);
        let sent = SentClaim::new(self, *scope, lease.clone(), claim.lease);
        let row = self
            .bounded_by_deadline("claiming a key in PostgreSQL", |deadline| {
                sqlx::query(&self.shared.sql.begin)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(&lease))
                    .bind(epoch_i64(claim.epoch))
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        sent.answered();
        let corrupt = |e| StoreError::with_source("corrupt row in PostgreSQL", e);
        let held: Vec<u8> = row.try_get("token").map_err(corrupt)?;
        if held == token {
            return Ok(Begin::Claimed { lease });
        }
        live_row(&row)
    }

    async fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> Result<Renewal, StoreError> {
        let token = token_bytes(lease);
        let extended = self
            .bounded_by_deadline("renewing a claim in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.renew)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if extended == 1 {
            return Ok(Renewal::Extended);
        }
        let restored = self
            .bounded_by_deadline("restoring a claim in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.restore)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&claim.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(lease))
                    .bind(epoch_i64(claim.epoch))
                    .bind(millis_i64(claim.lease))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        Ok(if restored == 1 {
            Renewal::Restored
        } else {
            Renewal::Lost
        })
    }

    async fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let token = token_bytes(lease);
        let encoded = encode_record(&record)?;
        let status = status_i16(&record);
        let stored = self
            .bounded_by_deadline("storing a record in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.complete)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(status)
                    .bind(&encoded)
                    .bind(millis_i64(ttl))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if stored == 1 {
            return Ok(Completion::Stored);
        }
        // The claim is not live: the lease ran out, the row is gone, or this is a
        // repeat of a completion whose answer was lost.
        let late = self
            .bounded_by_deadline("storing a record in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.complete_late)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(&record.fingerprint.as_bytes()[..])
                    .bind(first_seen_ms(lease))
                    .bind(epoch_i64(record.epoch))
                    .bind(status)
                    .bind(&encoded)
                    .bind(millis_i64(ttl))
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        if late == 1 {
            return Ok(Completion::StoredWithoutClaim);
        }
        let holder: Option<(bool, bool)> = self
            .bounded(
                "reading a record in PostgreSQL",
                sqlx::query_as(&self.shared.sql.completed_by)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .fetch_optional(&self.shared.pool),
            )
            .await?;
        Ok(match holder {
            Some((true, _)) => Completion::Stored,
            Some((false, true)) => Completion::Superseded,
            // Another live claim; or none since the late insert (released meanwhile):
            // either way, try again.
            Some((false, false)) | None => Completion::ClaimedByAnother,
        })
    }

    async fn release(&self, scope: &ScopeKey, lease: &Lease) -> Result<bool, StoreError> {
        let token = token_bytes(lease);
        let released = self
            .bounded_by_deadline("releasing a key in PostgreSQL", |deadline| {
                sqlx::query_scalar::<_, i64>(&self.shared.sql.release)
                    .bind(&scope.as_bytes()[..])
                    .bind(&token[..])
                    .bind(deadline)
                    .fetch_one(&self.shared.pool)
            })
            .await?;
        Ok(released == 1)
    }

    async fn wait(&self, scope: &ScopeKey, timeout: Duration) -> Result<Waited, StoreError> {
        if self.mode == PostgresMode::Transactional {
            return transaction::wait(&self.shared, scope, timeout).await;
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            let poll = self.bounded(
                "polling a key in PostgreSQL",
                sqlx::query(&self.shared.sql.poll)
                    .bind(&scope.as_bytes()[..])
                    .fetch_optional(&self.shared.pool),
            );
            let Ok(polled) = tokio::time::timeout_at(deadline, poll).await else {
                return Ok(Waited::TimedOut);
            };
            let Some(row) = polled? else {
                return Ok(Waited::Released);
            };
            let corrupt = |e| StoreError::with_source("corrupt row in PostgreSQL", e);
            let live: bool = row.try_get("live").map_err(corrupt)?;
            let completed: bool = row.try_get("completed").map_err(corrupt)?;
            match (completed, live) {
                (true, true) => {
                    let record: Vec<u8> = row.try_get("record").map_err(corrupt)?;
                    return Ok(Waited::Completed {
                        record: Arc::new(decode_record(&record)?),
                        request_count: None,
                    });
                }
                (_, false) => return Ok(Waited::Released),
                (false, true) => {}
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(Waited::TimedOut);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }
}
