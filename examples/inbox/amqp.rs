//! Payments from a RabbitMQ queue, through the library's driver: a prefetch of
//! deliveries handled at once, each acknowledged only once the inbox has committed (or
//! replayed) it.

use std::time::Duration;

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions},
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use tower_ids::idempotency::{message::amqp::AmqpConsumer, Stopped};

use crate::{shutdown, Inbox, Payment, RETRY_PAUSE};

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

/// Consumes the queue until Ctrl-C or SIGTERM, then drains within `drain`; names the
/// deliveries the drain left (they go back to the queue).
pub(crate) async fn consume(args: &AmqpArgs, inbox: Inbox, drain: Duration) -> Stopped {
    let stop = async {
        shutdown::signal().await;
    };
    AmqpConsumer::new(&args.amqp_url, &args.queue)
        .prefetch(args.prefetch)
        .retry_pause(RETRY_PAUSE)
        .drain_timeout(drain)
        .run(inbox, stop)
        .await
}
