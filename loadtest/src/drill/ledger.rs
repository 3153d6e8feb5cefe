//! The ledger as an auditor reads it, straight from PostgreSQL.

use anyhow::Context;
use sqlx::{Connection, Row};

/// One team's books.
#[derive(Debug, Clone)]
pub struct TeamBooks {
    /// The team.
    pub team_id: i64,
    /// Its balance now, microcredits.
    pub balance: i64,
    /// Every credit entry, summed.
    pub credits: i64,
    /// The cost of its settled rows, summed.
    pub settled_cost: i64,
}

/// The ledger's state.
#[derive(Debug, Clone)]
pub struct Books {
    /// Rows still reserved.
    pub open: i64,
    /// Rows settled.
    pub settled: i64,
    /// Rows cancelled.
    pub cancelled: i64,
    /// Every team's books.
    pub teams: Vec<TeamBooks>,
}

/// Reads the books of the database at `db_url`.
pub async fn books(db_url: &str) -> anyhow::Result<Books> {
    let mut conn = sqlx::PgConnection::connect(db_url)
        .await
        .context("connecting to the drill's database")?;
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE status = 'reserved'), \
                count(*) FILTER (WHERE status = 'settled'), \
                count(*) FILTER (WHERE status = 'cancelled') FROM usage_ledger",
    )
    .fetch_one(&mut conn)
    .await?;
    let (open, settled, cancelled): (i64, i64, i64) =
        (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
    let teams = sqlx::query(
        "SELECT t.id, t.balance_microcredits, \
           (SELECT coalesce(sum(amount_microcredits), 0)::BIGINT FROM credit_entries c WHERE c.team_id = t.id), \
           (SELECT coalesce(sum(cost_microcredits), 0)::BIGINT FROM usage_ledger u \
              WHERE u.team_id = t.id AND u.status = 'settled') \
         FROM teams t ORDER BY t.id",
    )
    .fetch_all(&mut conn)
    .await?
    .into_iter()
    .map(|r| {
        Ok(TeamBooks {
            team_id: r.try_get(0)?,
            balance: r.try_get(1)?,
            credits: r.try_get(2)?,
            settled_cost: r.try_get(3)?,
        })
    })
    .collect::<Result<Vec<_>, sqlx::Error>>()?;
    conn.close().await?;
    Ok(Books {
        open,
        settled,
        cancelled,
        teams,
    })
}
