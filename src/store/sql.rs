//! Helpers both SQL stores share: how database failures and counts map onto the store's
//! and the ledger's errors.

use switchyard_actors::ports::LedgerError;

use super::StoreError;

pub(super) fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

pub(super) fn ledger_unavailable(e: sqlx::Error) -> LedgerError {
    LedgerError::Unavailable(e.to_string())
}

pub(super) fn found(rows_affected: u64) -> Result<(), StoreError> {
    if rows_affected == 0 {
        Err(StoreError::NotFound)
    } else {
        Ok(())
    }
}

/// Token counts are u64 at the port and a signed 64-bit column in both databases; a count
/// beyond i64 is refused rather than clamped, so the ledger never records a number nobody
/// produced.
pub(super) fn tokens(n: u64) -> Result<i64, LedgerError> {
    i64::try_from(n).map_err(|_| LedgerError::Unavailable(format!("token count {n} out of range")))
}
