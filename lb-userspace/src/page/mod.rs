//! The live status page, served read-only on the metrics listener next to
//! `/metrics`: `/` is one self-contained page (HTML, CSS and script in
//! `status.html`, embedded in the binary: no build step, nothing loaded
//! from elsewhere) that fetches `/status.json` every second and re-renders;
//! `/status.json` is the status report exactly as `lbctl status --json`
//! prints it.
use crate::report::Status;

/// The page, as served at `/`.
pub const HTML: &str = include_str!("status.html");

/// `/status.json`: `status` as `lbctl status --json` prints it. The control
/// API sends the report as a JSON value (objects keyed in sorted order) and
/// lbctl pretty-prints that value and ends it with a newline; so does this.
pub fn status_json(status: &Status) -> Result<String, serde_json::Error> {
    let value = serde_json::to_value(status)?;
    let mut text = serde_json::to_string_pretty(&value)?;
    text.push('\n');
    Ok(text)
}
