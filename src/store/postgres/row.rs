//! A row as the store reads it, whichever driver fetched it: its columns by position,
//! NULL (or a column of another type) read as `None`. The claim's decision and a
//! look-up's record (`claim::found`, `look_up::record`) read rows through it, so that
//! both drivers share them; a driver converts its own row type.

use std::time::SystemTime;

use super::errors::corrupt;
use crate::store::StoreError;

/// The columns of a row, by position.
pub(crate) trait Columns {
    fn int8(&self, i: usize) -> Option<i64>;
    fn int2(&self, i: usize) -> Option<i16>;
    fn int4(&self, i: usize) -> Option<i32>;
    fn boolean(&self, i: usize) -> Option<bool>;
    fn text(&self, i: usize) -> Option<&str>;
    fn bytes(&self, i: usize) -> Option<&[u8]>;
    fn time(&self, i: usize) -> Option<SystemTime>;
}

/// The value of column `i`, which the statement never returns NULL in.
pub(crate) fn need<T>(value: Option<T>, i: usize) -> Result<T, StoreError> {
    value.ok_or_else(|| corrupt(&format!("column {i} is NULL or of another type")))
}

impl Columns for tokio_postgres::Row {
    fn int8(&self, i: usize) -> Option<i64> {
        self.try_get(i).ok().flatten()
    }
    fn int2(&self, i: usize) -> Option<i16> {
        self.try_get(i).ok().flatten()
    }
    fn int4(&self, i: usize) -> Option<i32> {
        self.try_get(i).ok().flatten()
    }
    fn boolean(&self, i: usize) -> Option<bool> {
        self.try_get(i).ok().flatten()
    }
    fn text(&self, i: usize) -> Option<&str> {
        self.try_get(i).ok().flatten()
    }
    fn bytes(&self, i: usize) -> Option<&[u8]> {
        self.try_get(i).ok().flatten()
    }
    fn time(&self, i: usize) -> Option<SystemTime> {
        self.try_get(i).ok().flatten()
    }
}
