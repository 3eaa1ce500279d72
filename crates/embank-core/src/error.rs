//! One error type for the whole engine: a kind, a message, optional context and source.
//!
//! Bindings map [`ErrorKind`] to their own error types in one place each
//! (the Python module maps every kind to a fitting exception class).

use std::fmt;

/// What went wrong, coarse enough for callers to branch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The operating system refused an operation (open, mmap, msync, ...).
    Io,
    /// Options or configuration that cannot work (dim 0, capacity 0, ...).
    Config,
    /// Input of a call is wrong: wrong dim, wrong length, bad name.
    InvalidInput,
    /// A table (or other named thing) does not exist.
    NotFound,
    /// A table of that name exists already.
    AlreadyExists,
    /// The table cannot take more rows and growth is turned off.
    TableFull,
    /// Stored bytes do not match their checksum.
    ChecksumMismatch,
    /// Files written by a format version this build does not read.
    FormatVersion,
    /// Repairing a store after a crash failed.
    Recover,
    /// Another process (or handle) holds the store's lock.
    Locked,
    /// The store or table was closed.
    Closed,
    /// Not supported by this build or medium.
    Unsupported,
    /// A wait ran out of time.
    Timeout,
    /// An internal invariant was broken: a bug, please report it.
    Corrupt,
    /// A server refused the connection's credentials (remote stores).
    Unauthorized,
    /// A server (shard) cannot be reached or is at its connection limit (remote stores).
    Unavailable,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Io => "io",
            ErrorKind::Config => "config",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::TableFull => "table full",
            ErrorKind::ChecksumMismatch => "checksum mismatch",
            ErrorKind::FormatVersion => "format version",
            ErrorKind::Recover => "recover",
            ErrorKind::Locked => "locked",
            ErrorKind::Closed => "closed",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Unavailable => "unavailable",
        }
    }
}

/// The engine's error: `kind: message (context): source`.
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), context: Vec::new(), source: None }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// Adds where the error happened (a path, a table name), outermost last.
    pub fn context(mut self, context: impl Into<String>) -> Self {
        self.context.push(context.into());
        self
    }

    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    pub fn io(message: impl Into<String>, source: std::io::Error) -> Self {
        Error::new(ErrorKind::Io, message).with_source(source)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, message)
    }

    pub fn config(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Config, message)
    }

    pub fn corrupt(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Corrupt, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        for c in self.context.iter().rev() {
            write!(f, " ({c})")?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Error({}: {self})", self.kind.as_str())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|s| s.as_ref() as &(dyn std::error::Error + 'static))
    }
}

/// Shorthand for an [`ErrorKind::Io`] error naming the path involved.
pub(crate) fn io_at(what: &str, path: &std::path::Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", path.display()), e)
}
