//! Runs: one generation's lifecycle, as a pure state machine ([`RunMachine`]) and the async
//! shell that carries out its outputs ([`crate::driver`]).
//!
//! A run waits for a ready epoch, opens its sequence on every stage, starts the first stage,
//! relays the tokens the sampling stage reports, and closes the sequence everywhere when it
//! ends. When its epoch is lost it pauses, and resumes on the next ready epoch by
//! re-prefilling prompt + generated under a fresh stage-side id. Cancelling is an input like
//! any other; timeouts are timers the machine arms and the shell fires.
//!
//! ```
//! use std::time::Duration;
//! use tessera_coord::run::{Input, Output, RunMachine, RunSpec};
//!
//! let spec = RunSpec::new(vec![1, 2, 3], 32, Default::default(), 4, vec![]).unwrap();
//! let (mut run, first) = RunMachine::new(spec, Duration::from_secs(3));
//! assert_eq!(first, vec![Output::AwaitEpoch { lost: None }]);
//! // The owner gives up before any epoch was ready: the run ends at once.
//! let out = run.handle(Duration::ZERO, Input::Cancel);
//! assert!(matches!(out.as_slice(), [Output::Done(_)]));
//! assert!(run.is_done());
//! ```

mod machine;
#[cfg(test)]
mod tests;

pub use machine::{
    Fault, Input, InvalidRun, Output, Placement, RunEvent, RunMachine, RunOutcome, RunSpec, Timer,
    TimerKind, CLOSE_TIMEOUT, OPEN_TIMEOUT, RESUME_TIMEOUT, STEP_TIMEOUT,
};
