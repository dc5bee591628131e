//! Storyboard files: one shot a line, as JSON Lines or CSV.
//!
//! A line holds a [`ShotJob`]'s fields plus an optional `priority` (`p0`, `p1`, `p2`; default
//! `p1`); `v` may be left out (it is 1). CSV columns have the same names; `loras` is written
//! `name:weight;name:weight`, the floor as `floor_min_side` and `floor_min_steps`. Every line
//! is decoded and validated exactly as a worker would, and every bad line is reported with its
//! number and field.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};
use shotfleet_schema::{Limits, Priority, ShotJob, job};

/// One shot read from a file, ready to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Shot {
    /// 1-based line number in the file.
    pub line: usize,
    pub priority: Priority,
    pub job: ShotJob,
}

/// A line that cannot be published, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    pub line: usize,
    /// The field at fault (`width`, `loras[0].name`), or empty when the line as a whole is.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "line {}: {}", self.line, self.message)
        } else {
            write!(f, "line {}: field `{}`: {}", self.line, self.field, self.message)
        }
    }
}

/// What a file holds: the good shots and the bad lines.
#[derive(Debug, Default)]
pub struct Storyboard {
    pub shots: Vec<Shot>,
    pub errors: Vec<LineError>,
}

/// The two formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    JsonLines,
    Csv,
}

impl Format {
    /// By extension (`.jsonl`, `.ndjson`, `.json`, `.csv`); otherwise by the first character
    /// (after a byte order mark).
    pub fn detect(path: &Path, text: &str) -> Self {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("csv") => Self::Csv,
            Some("jsonl" | "ndjson" | "json") => Self::JsonLines,
            _ if text.trim_start().starts_with(['{', '[']) => Self::JsonLines,
            _ => Self::Csv,
        }
    }
}

/// Reads and validates a storyboard file; `ignore` names the columns (or JSON fields) a person
/// keeps for themselves (notes, dialogue, camera), left out instead of refused as unknown.
///
/// # Errors
/// Only when the file cannot be read; bad lines are in [`Storyboard::errors`].
pub fn read(path: &Path, limits: &Limits, ignore: &[String]) -> std::io::Result<Storyboard> {
    let bytes = std::fs::read(path)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        let utf16 = bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff]);
        let was = if utf16 { "UTF-16 (\"Unicode text\")" } else { "another encoding (Windows-1252 or Latin-1?)" };
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("line {line}: not UTF-8 text (byte {at}); it looks like {was}: save it as UTF-8 (\"CSV UTF-8\" in a spreadsheet)"),
        )
    })?;
    Ok(parse_ignoring(&text, Format::detect(path, &text), limits, ignore))
}

/// Parses storyboard text in the given format.
pub fn parse(text: &str, format: Format, limits: &Limits) -> Storyboard {
    parse_ignoring(text, format, limits, &[])
}

/// [`parse`], leaving out the columns or fields named in `ignore` (any case).
pub fn parse_ignoring(text: &str, format: Format, limits: &Limits, ignore: &[String]) -> Storyboard {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let ignore: Vec<String> = ignore.iter().map(|name| name.trim().to_lowercase()).collect();
    let rows = match format {
        Format::JsonLines => json_rows(text, &ignore),
        Format::Csv => csv_rows(text, &ignore),
    };
    let mut board = Storyboard::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for row in rows {
        match row.and_then(|(line, object)| shot_from_row(line, object, limits)) {
            Ok(shot) => {
                // Ids are unique within a project: two episodes may both have `shot-001`.
                if let Some(first) = seen.insert(shot.job.key(), shot.line) {
                    board.errors.push(LineError {
                        line: shot.line,
                        field: "job_id".into(),
                        message: format!("`{}` is already used on line {first} in project `{}`", shot.job.job_id, shot.job.project),
                    });
                } else {
                    board.shots.push(shot);
                }
            }
            Err(e) => board.errors.push(e),
        }
    }
    board
}

type Row = Result<(usize, Map<String, Value>), LineError>;

fn whole_line(line: usize, message: impl Into<String>) -> LineError {
    LineError { line, field: String::new(), message: message.into() }
}

/// One object a line; blank lines and comments (`//` or `#`) are skipped. A file that is one
/// JSON array of objects (a `.json` export) is read as such, each object's line its own, and so
/// is one of objects written one after another over several lines each (pretty-printed).
fn json_rows(text: &str, ignore: &[String]) -> Vec<Row> {
    if text.trim_start().starts_with('[') {
        return json_array_rows(text, ignore);
    }
    let by_line: Vec<Row> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with("//") && !l.starts_with('#'))
        .map(|(line, l)| match serde_json::from_str::<Value>(l) {
            Ok(Value::Object(object)) => known_fields(line, object, ignore),
            Ok(_) => Err(whole_line(line, "expected a JSON object")),
            Err(e) => Err(whole_line(line, format!("not valid JSON: {e}"))),
        })
        .collect();
    if by_line.iter().any(Result::is_err)
        && let Some(rows) = pretty_printed_rows(text, ignore)
    {
        return rows;
    }
    by_line
}

/// The objects of a text that is JSON objects one after another, each over several lines (as
/// an editor's "format document" writes them), each named by the line it starts on; `None`
/// unless the whole text reads so.
fn pretty_printed_rows(text: &str, ignore: &[String]) -> Option<Vec<Row>> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let mut rows = Vec::new();
    loop {
        let after = values.byte_offset();
        match values.next() {
            None => break,
            Some(Ok(Value::Object(object))) => {
                let start = after + (text[after..].len() - text[after..].trim_start().len());
                rows.push(known_fields(text[..start].matches('\n').count() + 1, object, ignore));
            }
            Some(_) => return None,
        }
    }
    (!rows.is_empty()).then_some(rows)
}

/// The objects of a JSON array, each named by the line it starts on.
fn json_array_rows(text: &str, ignore: &[String]) -> Vec<Row> {
    // Raw elements borrow the text, so where each starts is where its slice starts.
    let elements: Vec<&serde_json::value::RawValue> = match serde_json::from_str(text) {
        Ok(elements) => elements,
        Err(e) => return vec![Err(whole_line(e.line(), format!("not a valid JSON array of shots: {e}")))],
    };
    elements
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            let at = raw.get().as_ptr() as usize - text.as_ptr() as usize;
            let line = text[..at].matches('\n').count() + 1;
            match serde_json::from_str(raw.get()) {
                Ok(Value::Object(object)) => known_fields(line, object, ignore),
                _ => Err(whole_line(line, format!("element {} of the array is not a JSON object", i + 1))),
            }
        })
        .collect()
}

/// The fields a storyboard line may have: a job's, and its priority.
const JSON_FIELDS: [&str; 15] = [
    "v", "job_id", "project", "shot_id", "prompt", "negative_prompt", "width", "height", "steps", "guidance", "seed", "images",
    "loras", "floor", "priority",
];

/// The object when every field is one a shot has: a misspelt field (`lora`, `image`,
/// `negativ_prompt`) would else be dropped and the shot rendered without it, unsaid.
fn known_fields(line: usize, mut object: Map<String, Value>, ignore: &[String]) -> Row {
    object.retain(|name, _| !ignore.contains(&name.to_lowercase()));
    if let Some(unknown) = job::unknown_fields(&object, &JSON_FIELDS).into_iter().next() {
        let near = did_you_mean(unknown.near);
        // Inside `loras` or `floor`: a shot has no such field, and no column to leave out.
        let message = match (unknown.within, unknown.path.as_str()) {
            (None, "degrade") => "set by workers only: leave it out".to_owned(),
            (None, top) => format!("unknown field; {near}known fields are {} (`--ignore-column {top}` leaves it out)", JSON_FIELDS.join(", ")),
            (Some("floor"), _) => format!("unknown field; {near}the floor has {}", job::FLOOR_FIELDS.join(" and ")),
            (Some(_), _) => format!("unknown field; {near}a LoRA has {}", job::LORA_FIELDS.join(" and ")),
        };
        return Err(LineError { line, field: unknown.path, message });
    }
    Ok((line, object))
}

/// `did you mean `name`? ` for a known name a typo or two away, else nothing.
fn did_you_mean(near: Option<&str>) -> String {
    near.map(|near| format!("did you mean `{near}`? ")).unwrap_or_default()
}

/// Columns that hold numbers; everything else is text.
const NUMERIC_COLUMNS: [&str; 9] =
    ["v", "width", "height", "steps", "guidance", "seed", "images", "floor_min_side", "floor_min_steps"];
const TEXT_COLUMNS: [&str; 7] = ["job_id", "project", "shot_id", "prompt", "negative_prompt", "priority", "loras"];

/// The header line's separator: a comma, or the semicolon (a European spreadsheet's export) or
/// tab that the header is split by instead.
fn delimiter(text: &str) -> u8 {
    let header = text.lines().next().unwrap_or_default();
    [b',', b';', b'\t'].into_iter().max_by_key(|d| header.bytes().filter(|b| b == d).count()).unwrap_or(b',')
}

/// A quoted cell that runs over a line's end. The csv crate reads a quoted cell on to the
/// next quote, however many lines on, so a quote left open swallows the rows after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MultiLineCell {
    /// The line of the cell's opening quote.
    opened: usize,
    /// The line of the quote that ends it, `None` when none does.
    closed: Option<usize>,
    /// Surely a quote left open: it never closes, or its closing quote has more text after
    /// it. One that closes as RFC 4180 has it may be a multi-line prompt, or a runaway closed
    /// by a quote that happened to stand before a separator (`24x36",`).
    runaway: bool,
}

impl MultiLineCell {
    fn message(self) -> String {
        let fix = "close the quote on this line (a quote inside a cell is written \"\")";
        match self.closed {
            Some(closed) => {
                format!("a quote opened on this line closes only on line {closed}, so lines {}-{closed} were read as one row: {fix}", self.opened)
            }
            None => format!("a quote opened on this line is never closed, so the rest of the file was read into one cell: {fix}"),
        }
    }

    /// Said beside a row the csv crate could not read: a cell that spans lines is the likely
    /// cause, even one that closes as a multi-line prompt would.
    fn hint(self, problem: &str) -> String {
        match (self.runaway, self.closed) {
            (false, Some(closed)) => format!(
                "{problem}: a quoted cell opened on this line runs to line {closed}, so lines {}-{closed} were read as one row; \
                 if the cell was not meant to span lines, close its quote on this line (a quote inside a cell is written \"\")",
                self.opened
            ),
            _ => self.message(),
        }
    }
}

/// The [`MultiLineCell`]s of a CSV text. As RFC 4180 has it, a quote inside a quoted cell is
/// doubled and the closing quote is followed by the separator or the line's end; a quoted
/// cell of several lines that closes so may be a multi-line prompt.
fn multi_line_cells(text: &str, separator: u8) -> Vec<MultiLineCell> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let (mut line, mut cell_start, mut i) = (1, true, 0);
    // The line of the opening quote while inside a quoted cell.
    let mut quoted: Option<usize> = None;
    while i < bytes.len() {
        let byte = bytes[i];
        match quoted {
            Some(_) if byte == b'"' && bytes.get(i + 1) == Some(&b'"') => i += 1,
            Some(opened) if byte == b'"' => {
                quoted = None;
                cell_start = false;
                // Blanks after the closing quote are trimmed off the cell, as the reader does.
                let next = bytes[i + 1..].iter().copied().find(|&b| b != b' ' && b != b'\t' || b == separator);
                let ends_the_cell = next.is_none_or(|next| next == separator || next == b'\r' || next == b'\n');
                if line > opened {
                    found.push(MultiLineCell { opened, closed: Some(line), runaway: !ends_the_cell });
                }
            }
            Some(_) => {}
            None if byte == b'"' && cell_start => quoted = Some(line),
            None => cell_start = byte == separator || byte == b'\n',
        }
        if byte == b'\n' {
            line += 1;
        }
        i += 1;
    }
    found.extend(quoted.map(|opened| MultiLineCell { opened, closed: None, runaway: true }));
    found
}

fn csv_rows(text: &str, ignore: &[String]) -> Vec<Row> {
    let separator = delimiter(text);
    let mut reader = csv::ReaderBuilder::new().flexible(false).delimiter(separator).trim(csv::Trim::All).from_reader(text.as_bytes());
    let headers = match reader.headers() {
        Ok(h) => h.clone(),
        Err(e) => return vec![Err(whole_line(1, format!("cannot read the CSV header: {e}")))],
    };
    // A spreadsheet's header is often capitalized (`Job_ID`, `Prompt`).
    let headers: csv::StringRecord = headers.iter().map(str::to_lowercase).collect();
    // Before the twice-named check: two empty names are no column named twice.
    let blank: Vec<String> = headers.iter().enumerate().filter(|(_, h)| h.is_empty()).map(|(i, _)| (i + 1).to_string()).collect();
    if !blank.is_empty() {
        let (columns, are) = if blank.len() == 1 { ("column", "is") } else { ("columns", "are") };
        let message = format!("{columns} {} of the header {are} empty (trailing separators, as a spreadsheet may export?): remove them, or name them and leave them out with --ignore-column", blank.join(", "));
        return vec![Err(whole_line(1, message))];
    }
    if let Some((i, _)) = headers.iter().enumerate().find(|(i, h)| headers.iter().take(*i).any(|earlier| earlier == *h)) {
        return vec![Err(LineError { line: 1, field: headers[i].to_owned(), message: "this column is in the header twice".into() })];
    }
    let ignored = |name: &str| ignore.iter().any(|i| i == name);
    // Every unknown column at once, so a header is fixed in one go: a misspelt one (`Job ID`) is
    // to be renamed, and only a column of the user's own to be left out.
    let known: Vec<&str> = TEXT_COLUMNS.iter().chain(NUMERIC_COLUMNS.iter()).copied().collect();
    let unknown: Vec<Row> = headers
        .iter()
        .filter(|h| !known.contains(h) && !ignored(h))
        .map(|unknown| {
            let message = match shotfleet_schema::names::nearest(unknown, &known) {
                Some(near) => format!("unknown column; did you mean `{near}`? (rename the header cell)"),
                None => format!(
                    "unknown column; known columns are {} (a column of your own, notes or dialogue: `--ignore-column {unknown}` leaves it out)",
                    known.join(", ")
                ),
            };
            Err(LineError { line: 1, field: unknown.to_owned(), message })
        })
        .collect();
    if !unknown.is_empty() {
        return unknown;
    }
    let spanning = multi_line_cells(text, separator);
    let mut lines = Lines { text, at: 0, line: 1 };
    reader
        .records()
        .map(|record| {
            let record = record.map_err(|e| {
                let line = e.position().map_or(0, |p| lines.of_record_at(p.byte()));
                // A record's first cell of several lines opens on the record's first line.
                let problem = format!("malformed CSV: {}", csv_error_kind(&e));
                match spanning.iter().find(|cell| cell.opened == line) {
                    Some(cell) => whole_line(line, cell.hint(&problem)),
                    None => whole_line(line, problem),
                }
            })?;
            let line = record.position().map_or(0, |p| lines.of_record_at(p.byte()));
            let spans = record.iter().map(|cell| cell.matches('\n').count()).sum::<usize>();
            if let Some(runaway) = spanning.iter().find(|cell| cell.runaway && (line..=line + spans).contains(&cell.opened)) {
                return Err(whole_line(runaway.opened, runaway.message()));
            }
            // A spreadsheet's export ends in rows of empty cells: nothing, as a blank line is.
            // So is a row of the ignored columns alone (a scene's heading in a notes column).
            if headers.iter().zip(record.iter()).all(|(name, cell)| ignored(name) || cell.trim().is_empty()) {
                return Ok(None);
            }
            let mut object = Map::new();
            for (name, cell) in headers.iter().zip(record.iter()) {
                if cell.is_empty() || ignored(name) {
                    continue;
                }
                let value = if NUMERIC_COLUMNS.contains(&name) {
                    number_cell(line, name, cell, separator == b';')?
                } else if name == "loras" {
                    loras_cell(line, cell, separator == b';')?
                } else {
                    Value::String(cell.to_owned())
                };
                object.insert(name.to_owned(), value);
            }
            fold_floor(&mut object);
            Ok(Some((line, object)))
        })
        .filter_map(Result::transpose)
        .collect()
}

/// A number column's cell as a spreadsheet writes it: `30.0` where a whole number is meant is
/// that number, and a thousands separator (`1,024`) or text is said to be one. In a file
/// separated by semicolons (a European spreadsheet's export), `6,5` is a decimal comma.
fn number_cell(line: usize, name: &str, cell: &str, decimal_comma: bool) -> Result<Value, LineError> {
    let cell = cell.trim();
    let text = if decimal_comma && cell.matches(',').count() == 1 && !cell.contains('.') { cell.replace(',', ".") } else { cell.to_owned() };
    let number: serde_json::Number = serde_json::from_str(&text).map_err(|_| {
        let hint = if cell.contains(',') { " (write it without a thousands separator)" } else { "" };
        LineError { line, field: name.to_owned(), message: format!("`{cell}` is not a number{hint}") }
    })?;
    whole_number(line, name, &number)
}

/// A number field's value: `guidance` as it is; the others are whole numbers from 0, and one
/// written with a fraction of zero (`30.0`, as spreadsheets and some JSON writers write it) is
/// that number.
fn whole_number(line: usize, name: &str, number: &serde_json::Number) -> Result<Value, LineError> {
    let refused = |message: String| Err(LineError { line, field: name.to_owned(), message });
    if name == "guidance" || number.is_u64() {
        return Ok(Value::Number(number.clone()));
    }
    match number.as_f64() {
        Some(negative) if negative < 0.0 && name == "seed" => refused(format!(
            "`{number}` is negative: a seed is a whole number from 0 (`-1`, \"random\" in some tools, is not taken: a shot renders the same from its seed each time)"
        )),
        Some(negative) if negative < 0.0 => refused(format!("`{number}` is negative")),
        // Below 2^53, as the workers read such floats (`shotfleet_schema`'s wire rules).
        Some(whole) if whole.fract() == 0.0 && whole < 9_007_199_254_740_992.0 => Ok(Value::from(whole as u64)),
        Some(whole) if whole.fract() == 0.0 => refused(format!(
            "`{number}` was written with a decimal point or exponent: past 2^53 such a number no longer holds every integer, so write the integer itself"
        )),
        _ => refused(format!("`{number}` is not a whole number")),
    }
}

/// Line numbers of a CSV file's records, counted on from the last one asked (the records come
/// in order), so a long file is read once.
struct Lines<'a> {
    text: &'a str,
    /// The byte counted up to, and the line it is on (from 1).
    at: usize,
    line: usize,
}

impl Lines<'_> {
    /// The line where the record the csv crate places at `byte` starts. The crate's own line
    /// count leaves out blank lines and counts a CRLF file's lines short; its byte offset is
    /// where the previous record ended, before any blank lines.
    fn of_record_at(&mut self, byte: u64) -> usize {
        let bytes = self.text.as_bytes();
        let mut start = usize::try_from(byte).unwrap_or(usize::MAX).min(bytes.len());
        while bytes.get(start).is_some_and(|b| matches!(b, b'\r' | b'\n')) {
            start += 1;
        }
        if start >= self.at {
            self.line += bytes[self.at..start].iter().filter(|&&b| b == b'\n').count();
            self.at = start;
        }
        self.line
    }
}

/// What went wrong in a CSV record, without the crate's own position (its line is off; the
/// caller names the right one).
fn csv_error_kind(error: &csv::Error) -> String {
    match error.kind() {
        csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
            format!("{len} fields where the header has {expected_len}")
        }
        csv::ErrorKind::Utf8 { err, .. } => format!("not UTF-8 text: {err}"),
        _ => error.to_string(),
    }
}

/// `name:weight;name:weight` into the JSON form.
fn loras_cell(line: usize, cell: &str, decimal_comma: bool) -> Result<Value, LineError> {
    // LoRA names hold no `,`: `mei:0.8, hero:0.5` is two, as `;` separates them; in a file of
    // decimal commas (`mei:0,8;hero:0,5`) a comma before a digit is the weight's.
    let mut items = String::with_capacity(cell.len());
    let mut chars = cell.chars().peekable();
    while let Some(c) = chars.next() {
        let separates = c == ',' && !(decimal_comma && chars.peek().is_some_and(char::is_ascii_digit));
        items.push(if separates { ';' } else { c });
    }
    let loras = items
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let (name, weight) = item.rsplit_once(':').unwrap_or((item, "1"));
            let weight = if decimal_comma { weight.replace(',', ".") } else { weight.to_owned() };
            let weight: f64 = weight.trim().parse().ok().filter(|w: &f64| w.is_finite()).ok_or_else(|| LineError {
                line,
                field: "loras".into(),
                message: format!("`{item}`: weight `{weight}` is not a finite number (write name:weight;name:weight)"),
            })?;
            Ok(serde_json::json!({ "name": name.trim(), "weight": weight }))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Value::Array(loras))
}

fn fold_floor(object: &mut Map<String, Value>) {
    let side = object.remove("floor_min_side");
    let steps = object.remove("floor_min_steps");
    if side.is_some() || steps.is_some() {
        object.insert(
            "floor".into(),
            serde_json::json!({ "min_side": side.unwrap_or(Value::from(0)), "min_steps": steps.unwrap_or(Value::from(0)) }),
        );
    }
}

fn shot_from_row(line: usize, mut object: Map<String, Value>, limits: &Limits) -> Result<Shot, LineError> {
    let priority = match object.remove("priority") {
        None => Priority::P1,
        Some(Value::String(p)) => p.parse().map_err(|message| LineError { line, field: "priority".into(), message })?,
        Some(other) => {
            return Err(LineError { line, field: "priority".into(), message: format!("{other} is not p0, p1 or p2") });
        }
    };
    object.entry("v").or_insert(Value::from(shotfleet_schema::VERSION));
    // As a CSV cell's: `30.0` for a whole number, a negative seed named; no LoRAs for null.
    for name in NUMERIC_COLUMNS {
        if let Some(Value::Number(number)) = object.get(name) {
            let value = whole_number(line, name, number)?;
            object.insert(name.to_owned(), value);
        }
    }
    if object.get("loras").is_some_and(Value::is_null) {
        object.remove("loras");
    }
    let job: ShotJob = serde_path_to_error::deserialize(Value::Object(object)).map_err(|e| LineError {
        line,
        field: e.path().to_string().trim_start_matches('.').to_owned(),
        message: e.inner().to_string(),
    })?;
    job.validate(limits).map_err(|e| {
        let first = &e.problems[0];
        let rest: Vec<String> = e.problems[1..].iter().map(|p| format!("field `{}`: {}", p.field, p.message)).collect();
        let more = if rest.is_empty() { String::new() } else { format!(" (and {} more: {})", rest.len(), rest.join("; ")) };
        LineError { line, field: first.field.clone(), message: format!("{}{more}", first.message) }
    })?;
    Ok(Shot { line, priority, job })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_with_defaults_and_priority() {
        let text = r#"{"job_id":"a","project":"p","shot_id":"s1","prompt":"x","width":512,"height":512,"steps":20,"guidance":5,"seed":1,"priority":"p0"}

{"job_id":"b","project":"p","shot_id":"s2","prompt":"y","width":1024,"height":1024,"steps":20,"guidance":5,"seed":2}"#;
        let board = parse(text, Format::JsonLines, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        assert_eq!(board.shots.len(), 2);
        assert_eq!(board.shots[0].priority, Priority::P0);
        assert_eq!(board.shots[1].priority, Priority::P1);
        assert_eq!(board.shots[1].line, 3);
        assert_eq!(board.shots[1].job.v, 1);
    }

    #[test]
    fn csv_with_loras_and_floor() {
        let text = "job_id,project,shot_id,prompt,width,height,steps,guidance,seed,images,priority,loras,floor_min_side,floor_min_steps\n\
                    j1,acme,s1,\"a cat, at night\",768,512,25,6.5,9,2,p2,ink:0.8;hero.v1:1,512,10\n";
        let board = parse(text, Format::Csv, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        let shot = &board.shots[0];
        assert_eq!(shot.line, 2);
        assert_eq!(shot.priority, Priority::P2);
        assert_eq!(shot.job.prompt, "a cat, at night");
        assert_eq!(shot.job.loras.len(), 2);
        assert_eq!(shot.job.loras[1].name, "hero.v1");
        assert_eq!(shot.job.floor.unwrap().min_side, 512);
    }

    #[test]
    fn bad_lines_name_line_and_field() {
        let text = r#"{"job_id":"a","project":"p","shot_id":"s","prompt":"x","width":513,"height":512,"steps":20,"guidance":5,"seed":1}
{"job_id":"b","project":"p","shot_id":"s","prompt":"x","width":"big","height":512,"steps":20,"guidance":5,"seed":1}
not json
{"job_id":"c","project":"p","shot_id":"s","prompt":"x","width":512,"height":512,"steps":20,"guidance":5,"seed":1,"priority":"p9"}
{"job_id":"d","project":"p","shot_id":"s","prompt":"x","width":512,"height":512,"steps":20,"guidance":5,"seed":1}
{"job_id":"d","project":"p","shot_id":"s","prompt":"x","width":512,"height":512,"steps":20,"guidance":5,"seed":1}"#;
        let board = parse(text, Format::JsonLines, &Limits::default());
        let got: Vec<(usize, &str)> = board.errors.iter().map(|e| (e.line, e.field.as_str())).collect();
        assert_eq!(got, [(1, "width"), (2, "width"), (3, ""), (4, "priority"), (6, "job_id")]);
        assert_eq!(board.shots.len(), 1);
        assert!(board.errors[0].to_string().contains("line 1: field `width`: 513 must be a positive multiple of 8"));
    }

    #[test]
    fn csv_errors_name_the_file_line_with_crlf_and_blank_lines() {
        let header = "job_id,project,shot_id,prompt,width,height,steps,guidance,seed";
        let good = "ok-1,acme,s1,a cat,512,512,20,5,1";
        for newline in ["\n", "\r\n"] {
            // Line 1 header, 2 good, 3 blank, 4 bad width, 5 blank, 6 a field short.
            let text = [header, good, "", "bad-1,acme,s2,a dog,513,512,20,5,2", "", "short,acme,s3,a cow,512,512,20,5"].join(newline) + newline;
            let board = parse(&text, Format::Csv, &Limits::default());
            let got: Vec<usize> = board.errors.iter().map(|e| e.line).collect();
            assert_eq!(got, [4, 6], "{newline:?}: {:?}", board.errors);
            assert!(board.errors[1].to_string().contains("8 fields where the header has 9"), "{}", board.errors[1]);
        }
    }

    #[test]
    fn csv_unknown_column_is_refused() {
        let board = parse("job_id,widht\nx,5\n", Format::Csv, &Limits::default());
        assert_eq!(board.errors[0].field, "widht");
        assert!(board.errors[0].message.starts_with("unknown column; did you mean `width`?"), "{}", board.errors[0].message);
        // A spreadsheet's own header: every unknown column named, none but its own to leave out.
        let board = parse("Job ID,project,shot_id,prompt,width,height,steps,CFG,seed,Scene\nx,p,s,x,64,64,2,5,1,a\n", Format::Csv, &Limits::default());
        let said: Vec<(&str, &str)> = board.errors.iter().map(|e| (e.field.as_str(), e.message.as_str())).collect();
        assert_eq!(said.len(), 3, "{said:?}");
        assert_eq!(said[0], ("job id", "unknown column; did you mean `job_id`? (rename the header cell)"));
        assert!(said[1].0 == "cfg" && said[1].1.contains("`--ignore-column cfg`"), "{said:?}");
        assert!(said[2].0 == "scene" && said[2].1.contains("`--ignore-column scene`"), "{said:?}");
        // A spreadsheet's capitalized header reads.
        let board = parse("Job_ID,Project,Shot_ID,Prompt,Width,Height,Steps,Guidance,Seed\na,p,s,x,64,64,2,5,1\n", Format::Csv, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        assert_eq!(board.shots[0].job.job_id, "a");
    }

    const SHOT: &str = r#""job_id":"a1","project":"p","shot_id":"s1","prompt":"x","width":64,"height":64,"steps":2,"guidance":5,"seed":1"#;

    #[test]
    fn pretty_printed_shots_are_read_each_from_its_first_line() {
        let shot = |id: &str| serde_json::to_string_pretty(&serde_json::from_str::<Value>(&format!("{{{}}}", SHOT.replace("a1", id))).unwrap()).unwrap();
        let text = format!("{}\n{}\n", shot("a1"), shot("a2"));
        let board = parse(&text, Format::JsonLines, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        let lines: Vec<usize> = board.shots.iter().map(|s| s.line).collect();
        assert_eq!(lines, [1, shot("a1").lines().count() + 1]);
        // Not JSON as a whole: each line's own error stands.
        let broken = format!("{}\n{{\"job_id\":", shot("a1"));
        assert!(!parse(&broken, Format::JsonLines, &Limits::default()).errors.is_empty());
    }

    #[test]
    fn a_misspelt_json_field_is_refused_not_dropped() {
        let line = |id: &str, extra: &str| format!("{{{},{extra}}}", SHOT.replace("a1", id));
        let text = format!("{}\n{}\n", line("a1", r#""lora":[{"name":"mei","weight":1}]"#), line("a2", r#""image":4"#));
        let board = parse(&text, Format::JsonLines, &Limits::default());
        assert!(board.shots.is_empty(), "{:?}", board.shots);
        assert_eq!((board.errors[0].line, board.errors[0].field.as_str()), (1, "lora"));
        assert!(board.errors[0].message.contains("did you mean `loras`?"), "{}", board.errors[0].message);
        assert_eq!((board.errors[1].line, board.errors[1].field.as_str()), (2, "image"));
        assert!(board.errors[1].message.contains("did you mean `images`?"), "{}", board.errors[1].message);
        // Inside a LoRA entry and the floor too.
        let text = format!(
            "{}\n{}\n",
            line("a3", r#""loras":[{"name":"mei","weight":1,"strength":0.5}]"#),
            line("a4", r#""floor":{"min_side":64,"min_step":4}"#)
        );
        let board = parse(&text, Format::JsonLines, &Limits::default());
        assert!(board.shots.is_empty(), "{:?}", board.shots);
        assert_eq!((board.errors[0].line, board.errors[0].field.as_str()), (1, "loras[0].strength"));
        assert!(board.errors[0].message.contains("a LoRA has name and weight"), "{}", board.errors[0].message);
        assert_eq!(board.errors[1].field, "floor.min_step");
        assert!(board.errors[1].message.contains("did you mean `min_steps`?"), "{}", board.errors[1].message);
    }

    #[test]
    fn a_quote_left_open_is_named_not_swallowing_the_next_rows() {
        let header = "job_id,project,shot_id,prompt,width,height,steps,guidance,seed";
        // Closed by the next row's opening quote: that row vanished into the prompt.
        let text = format!("{header}\na1,p,s1,\"a cat,64,64,2,5,1\na2,p,s2,\"a dog\",64,64,2,5,1\na3,p,s3,x,64,64,2,5,1\n");
        let board = parse(&text, Format::Csv, &Limits::default());
        assert_eq!(board.errors.len(), 1, "{:?}", board.errors);
        assert_eq!(board.errors[0].line, 2);
        assert!(board.errors[0].message.starts_with("a quote opened on this line closes only on line 3, so lines 2-3"), "{}", board.errors[0].message);
        assert_eq!(board.shots.iter().map(|s| s.job.job_id.as_str()).collect::<Vec<_>>(), ["a3"]);
        // Never closed: the cell runs to the end of the file.
        let text = format!("{header}\na1,p,s1,\"a cat,64,64,2,5,1\na2,p,s2,x,64,64,2,5,1\n");
        let board = parse(&text, Format::Csv, &Limits::default());
        assert_eq!(board.errors[0].line, 2, "{:?}", board.errors);
        assert!(board.errors[0].message.contains("is never closed"), "{}", board.errors[0].message);
        // Closed as a multi-line cell would be (an inch mark at a line's end) but the row comes
        // out short: the cell that spans the lines is named beside the field count.
        let text = format!("{header},notes\na1,p,s1,\"a cat,64,64,2,5,1,\na2,p,s2,x,64,64,2,5,1,poster 24x36\"\na3,p,s3,x,64,64,2,5,1,\n");
        let board = parse_ignoring(&text, Format::Csv, &Limits::default(), &["notes".into()]);
        assert_eq!(board.errors.len(), 1, "{:?}", board.errors);
        assert_eq!(board.errors[0].line, 2);
        let message = &board.errors[0].message;
        assert!(message.contains("4 fields where the header has 10: a quoted cell opened on this line runs to line 3, so lines 2-3"), "{message}");
        assert_eq!(board.shots.iter().map(|s| s.job.job_id.as_str()).collect::<Vec<_>>(), ["a3"]);
        // Cells of several lines, quoted as spreadsheets write them, are prompts: comma-heavy
        // lines, a quote inside written twice, the first column.
        let text = format!(
            "{header}\n\
             a1,p,s1,\"SC 12 - night street\nmasterpiece, best quality, 1girl, yellow raincoat, night, streetlight, rain, bokeh, cinematic, 35mm\nlow angle\",64,64,2,5,1\n\
             a2,p,s2,\"the keeper says \"\"hi\"\",\nat dawn\",64,64,2,5,1\n\
             \"a3\n\",p,s3,x,64,64,2,5,1\n"
        );
        let board = parse(&text, Format::Csv, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        assert!(board.shots[0].job.prompt.starts_with("SC 12 - night street\nmasterpiece, best quality"));
        let spaced = parse(&format!("{header}\na1,p,s1,\"wide\nlow angle\" ,64,64,2,5,1\n"), Format::Csv, &Limits::default());
        assert!(spaced.errors.is_empty(), "a blank after the closing quote: {:?}", spaced.errors);
        assert_eq!(board.shots[1].job.prompt, "the keeper says \"hi\",\nat dawn");
        assert_eq!((board.shots[2].job.job_id.as_str(), board.shots[2].line), ("a3", 7), "cells are trimmed; lines counted through the cells");
    }

    #[test]
    fn a_job_id_is_unique_within_its_project() {
        let episode = |project: &str| SHOT.replace("\"project\":\"p\"", &format!("\"project\":\"{project}\""));
        let text = format!("{{{}}}\n{{{}}}\n{{{}}}\n", episode("ep1"), episode("ep2"), episode("ep1"));
        let board = parse(&text, Format::JsonLines, &Limits::default());
        let keys: Vec<String> = board.shots.iter().map(|s| s.job.key()).collect();
        assert_eq!(keys, ["ep1/a1", "ep2/a1"], "two episodes may both have a1");
        assert_eq!(board.errors.len(), 1, "{:?}", board.errors);
        assert_eq!((board.errors[0].line, board.errors[0].field.as_str()), (3, "job_id"));
        assert_eq!(board.errors[0].message, "`a1` is already used on line 1 in project `ep1`");
    }

    #[test]
    fn a_json_array_is_read_with_each_shots_line() {
        let text = format!("[\n  {{{SHOT}}},\n  {{{}}}\n]\n", SHOT.replace("a1", "a2").replace("\"steps\":2", "\"steps\":0"));
        let board = parse(&text, Format::detect(Path::new("board.json"), &text), &Limits::default());
        assert_eq!(board.shots.len(), 1, "{:?}", board.errors);
        assert_eq!(board.shots[0].line, 2);
        assert_eq!((board.errors[0].line, board.errors[0].field.as_str()), (3, "steps"));
        // By its first character too, after a byte order mark, whatever the file is called.
        let bom = '\u{feff}';
        assert_eq!(Format::detect(Path::new("board.txt"), &format!("{bom}{text}")), Format::JsonLines);
        assert_eq!(Format::detect(Path::new("board.txt"), &format!("{bom}{{{SHOT}}}")), Format::JsonLines);
    }

    #[test]
    fn a_spreadsheets_cells_are_read_as_a_person_wrote_them() {
        let header = "job_id;project;shot_id;prompt;width;height;steps;guidance;seed;priority;loras";
        // A European export: semicolons, and decimal commas.
        let text = format!(
            "{header}\na1; p ;s1;x;64;64;30.0;5.5;1; p0 ;\na2;p;s2;x;64;64;30,0;6,5;1;p1;mei:0.8, hero:0.5\na3;p;s3;x;64;64;2.5;5;1;p1;mei:nan\n"
        );
        let board = parse(&text, Format::Csv, &Limits::default());
        assert_eq!(board.shots.len(), 2, "{:?}", board.errors);
        let shot = &board.shots[0];
        assert_eq!((shot.job.project.as_str(), shot.job.steps, shot.priority), ("p", 30, Priority::P0));
        let shot = &board.shots[1];
        assert_eq!((shot.job.steps, shot.job.guidance), (30, 6.5));
        assert_eq!(shot.job.loras.iter().map(|l| (l.name.as_str(), l.weight)).collect::<Vec<_>>(), [("mei", 0.8), ("hero", 0.5)]);
        let decimal = parse(&format!("{header}\na4;p;s4;x;64;64;2;5;1;p1;\"mei:0,8; hero:0,5\"\n"), Format::Csv, &Limits::default());
        assert_eq!(decimal.shots[0].job.loras.iter().map(|l| l.weight).collect::<Vec<_>>(), [0.8, 0.5], "{:?}", decimal.errors);
        assert_eq!((board.errors[0].line, board.errors[0].field.as_str()), (4, "steps"));
        assert!(board.errors[0].message.contains("not a whole number"), "{}", board.errors[0].message);
        let comma = parse("job_id,project,shot_id,prompt,width,height,steps,guidance,seed\na,p,s,x,\"1,024\",64,2,5,1\n", Format::Csv, &Limits::default());
        assert!(comma.errors[0].message.contains("without a thousands separator"), "{:?}", comma.errors);
        let twice = parse("job_id,width,width\na,64,64\n", Format::Csv, &Limits::default());
        assert!(twice.errors[0].message.contains("in the header twice"), "{:?}", twice.errors);
        // A spreadsheet's export with two empty columns at the end of every line.
        let trailing = parse("job_id;width;;\na;64;;\n", Format::Csv, &Limits::default());
        assert!(trailing.errors[0].message.starts_with("columns 3, 4 of the header are empty"), "{:?}", trailing.errors);
        let trailing = parse("job_id,project,\na,p,\n", Format::Csv, &Limits::default());
        assert!(trailing.errors[0].message.contains("column 3 of the header is empty"), "{:?}", trailing.errors);
    }

    #[test]
    fn a_persons_own_columns_are_left_out_when_named() {
        let text = "Scene,job_id,project,shot_id,prompt,width,height,steps,guidance,seed,Notes\n\
                    \"Scene 1: the harbour\",,,,,,,,,,\n\
                    1,a1,p,s1,x,64,64,2,5,1,\"wide, dawn\"\n";
        let refused = parse(text, Format::Csv, &Limits::default());
        assert_eq!(refused.errors[0].field, "scene", "{:?}", refused.errors);
        assert!(refused.errors[0].message.contains("`--ignore-column scene` leaves it out"), "{}", refused.errors[0].message);
        let ignore = ["scene".to_owned(), "NOTES".to_owned()];
        let board = parse_ignoring(text, Format::Csv, &Limits::default(), &ignore);
        assert!(board.errors.is_empty(), "a heading row of the ignored columns alone is skipped: {:?}", board.errors);
        assert_eq!(board.shots.len(), 1);
        let json = format!("{{{SHOT},\"notes\":\"wide\"}}");
        assert_eq!(parse(&json, Format::JsonLines, &Limits::default()).errors[0].field, "notes");
        assert!(parse_ignoring(&json, Format::JsonLines, &Limits::default(), &ignore).errors.is_empty());
    }

    #[test]
    fn json_numbers_and_loras_read_as_a_csv_cells_do() {
        let line = |changed: &str| format!("{{{}}}", SHOT.replace("\"steps\":2", changed));
        let board = parse(&line(r#""steps":30.0,"loras":null"#), Format::JsonLines, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        assert_eq!(board.shots[0].job.steps, 30);
        let board = parse(&line(r#""steps":2,"seed":-1"#).replace("\"seed\":1", "\"images\":1"), Format::JsonLines, &Limits::default());
        assert_eq!(board.errors[0].field, "seed", "{:?}", board.errors);
        assert!(board.errors[0].message.contains("`-1` is negative: a seed is a whole number from 0"), "{}", board.errors[0].message);
        let board = parse(&line(r#""steps":2.5"#), Format::JsonLines, &Limits::default());
        assert!(board.errors[0].message.contains("`2.5` is not a whole number"), "{:?}", board.errors);
    }

    #[test]
    fn a_spreadsheets_empty_rows_are_skipped() {
        let text = "job_id,project,shot_id,prompt,width,height,steps,guidance,seed\r\na1,p,s1,x,64,64,2,5,1\r\n,,,,,,,,\r\n,,,,,,,,\r\n";
        let board = parse(text, Format::Csv, &Limits::default());
        assert!(board.errors.is_empty(), "{:?}", board.errors);
        assert_eq!(board.shots.len(), 1);
    }
}
