//! Where the model's parts go, as data: the coordinator seats what this crate decides, and the
//! lab and `tessera plan` use it without a coordinator.
//!
//! - [`assignment`]: stage assignments an operator gives (`--split 0..3,3..5`, a plan file, an
//!   expert split) and their resolution onto connected nodes;
//! - [`planning`]: measured inventory and links → the planner's resource graph → an executable
//!   plan → an [`assignment`].
//!
//! Pure: inventories, link measurements and policy come in as data; nothing here does I/O.

#![forbid(unsafe_code)]

pub mod assignment;
pub mod planning;
