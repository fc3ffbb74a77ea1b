//! The JSON lines a `tessera` process prints on stdout with `TESSERA_LOG_FORMAT=json`: its
//! events (`joined`, `plan_auto`, …) and announcements (`join_token`, …), one object a line.
//! The lab finds a line by its event's name and reads the fields it needs from it, typed; the
//! rest of the line (message, level, other fields) is ignored.

use serde::de::DeserializeOwned;
use serde::Deserialize;

/// A line's event name alone: other fields of other events (a token id, an epoch) never make
/// the line waited for unreadable.
#[derive(Deserialize)]
struct Named {
    event: Option<String>,
}

/// `line` read as `T` when it is the event `event`; `None` for any other line (another event,
/// a line that is not JSON).
pub(crate) fn read<T: DeserializeOwned>(line: &str, event: &str) -> Option<serde_json::Result<T>> {
    let named: Named = serde_json::from_str(line).ok()?;
    (named.event.as_deref() == Some(event)).then(|| serde_json::from_str(line))
}

/// An announced token (`join_token`, `operator_token`): `TOKEN@ADDR`.
#[derive(Debug, Deserialize)]
pub(crate) struct Announced {
    pub(crate) token: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_read_only_when_it_is_the_event_asked() {
        let join = r#"{"event":"join_token","token":"T@1.2.3.4:7070","message":"join token"}"#;
        let read_token = |l: &str, e: &str| read::<Announced>(l, e).map(|r| r.map(|a| a.token));
        assert_eq!(
            read_token(join, "join_token").unwrap().unwrap(),
            "T@1.2.3.4:7070"
        );
        assert!(read_token(join, "operator_token").is_none());
        assert!(read_token("listening on 1.2.3.4", "join_token").is_none());
        // Another event's `token` of another type does not hide the one waited for.
        assert!(read_token(r#"{"event":"step","token":17}"#, "join_token").is_none());
        // The event waited for without the field it must carry is unreadable, not skipped.
        assert!(read_token(r#"{"event":"join_token"}"#, "join_token")
            .unwrap()
            .is_err());
    }
}
