//! Migrations for tables named by the user: the store's own, and any table a crate
//! keeps beside it (the tower-ids outbox's), each written once for its default name
//! and run for the name configured.

use sqlx::PgPool;

/// Whether `table` is `name` or `schema.name` of plain identifiers (letters, digits,
/// `_`, not starting with a digit): safe to write into SQL. The outbox's tables too.
pub fn valid_table(table: &str) -> bool {
    let parts: Vec<&str> = table.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// Runs the migration `template`, written for `default_table`, for `table`: the table
/// and every index named after it (`{default_table}_...`) renamed. One replica at a
/// time: replicas starting together would race on `CREATE ... IF NOT EXISTS` (it can
/// fail on the catalog's unique index). One simple query is one transaction, so the
/// lock on the name is held to its end. (`table` was checked to be plain identifiers,
/// so it cannot close the literal.) The outbox's migration too.
pub async fn migrate_from_template(
    pool: &PgPool,
    template: &str,
    default_table: &str,
    table: &str,
) -> Result<(), sqlx::Error> {
    let sql = for_table(template, default_table, table);
    // One implicit transaction: the lock, then the statements, without the server's
    // "already exists, skipping" notices (sqlx logs each at INFO, on every start).
    let locked = format!(
        "SET LOCAL client_min_messages = warning;\n\
         SELECT pg_advisory_xact_lock(hashtext('tower-ids migrate {table}'));\n{sql}"
    );
    sqlx::raw_sql(&locked).execute(pool).await.map(|_| ())
}

/// `template` for `table`: index names first (they contain the default table's name,
/// and take the bare table name, without its schema), then the table.
pub fn for_table(template: &str, default_table: &str, table: &str) -> String {
    let bare = table.rsplit('.').next().unwrap_or(table);
    template
        .replace(&format!("{default_table}_"), &format!("\u{0}{bare}_"))
        .replace(default_table, table)
        .replace('\u{0}', "")
}
