//! A store that could not answer, and an error's causes for a log field.

/// A store that could not answer.
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    exhausted: bool,
}

impl StoreError {
    /// An error described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
            exhausted: false,
        }
    }

    /// An error caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(source.into()),
            exhausted: false,
        }
    }

    /// The store is up but had no room for the call (every connection of its pool was
    /// in use for as long as the call could wait): the layers answer that with a code
    /// of its own (`idempotency.pool_exhausted`), whatever the store-failure rule, as
    /// running more work would only add to the load.
    pub fn exhausted(mut self) -> Self {
        self.exhausted = true;
        self
    }

    /// Whether the store had no room for the call ([`exhausted`](Self::exhausted)).
    pub fn is_exhausted(&self) -> bool {
        self.exhausted
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// An error and its causes, `: `-separated, for a log field: "claiming a key in Redis:
/// Connection refused", not just "claiming a key in Redis".
#[doc(hidden)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}
