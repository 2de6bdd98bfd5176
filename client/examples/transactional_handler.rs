//! A handler whose work is in the same database, run inside the transaction that records its
//! ack (`start_in_transaction`), and failing with `anyhow` errors through `?`.
//!
//! `cargo run -p sqlstreams-client --example transactional_handler` with DATABASE_URL set to a
//! database with the extension (`scripts/rig demo` starts one).

use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sqlstreams_client::{Client, ConsumerConfig, Delivery, HandlerError, Tx};

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    account: String,
    cents: i64,
}

/// Applies a payment to a balance table; the balance and the ack commit together.
async fn apply(payment: Delivery<Payment>, tx: Tx) -> Result<(), HandlerError> {
    let p = payment.message;
    let updated = tx
        .execute("UPDATE balances SET cents = cents + $2 WHERE account = $1", &[&p.account, &p.cents])
        .await
        .context("updating the balance")?;
    if updated == 0 {
        return Err(HandlerError::permanent(format!("no account {}", p.account)));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL")?;
    let client = Client::connect(&url)?;
    client
        .pool()
        .get()
        .await?
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS sqlstreams;
             CREATE TABLE IF NOT EXISTS balances (account text PRIMARY KEY, cents bigint NOT NULL);
             INSERT INTO balances VALUES ('acct-42', 0) ON CONFLICT DO NOTHING;",
        )
        .await?;
    let payments = client.stream::<Payment>("payments");
    payments.register().await?;
    payments.producer().produce(&Payment { account: "acct-42".into(), cents: 1250 }, Default::default()).await?;
    let consumer = payments.consumer("ledger").register(ConsumerConfig::default()).await?;
    let running = consumer.start_in_transaction(apply);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    let cents: i64 =
        client.pool().get().await?.query_one("SELECT cents FROM balances WHERE account = 'acct-42'", &[]).await?.get(0);
    println!("applied {} payment(s); acct-42 has {cents} cents", report.metrics.succeeded);
    Ok(())
}
