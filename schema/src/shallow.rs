//! Reads a string field at the top of a MessagePack map without descending into the other
//! values: for naming a job whose payload nests deeper than a decode may go (rmp-serde descends
//! by recursion, so [`crate::encoding`] stops it at a depth a worker's stack holds, and the job's
//! ids went with it). Values are passed over by counting what they hold, never by recursion, so
//! any nesting costs one step per byte at most.

use rmp::Marker;

/// The string value of `field` in the MessagePack map that `payload` starts with: `None` when
/// the payload is no map, the field is absent or no string, or the bytes end first.
pub(crate) fn top_level_str<'a>(payload: &'a [u8], field: &str) -> Option<&'a str> {
    let mut reader = Reader { bytes: payload, at: 0 };
    let entries = match reader.marker()? {
        Marker::FixMap(n) => u64::from(n),
        Marker::Map16 => reader.uint(2)?,
        Marker::Map32 => reader.uint(4)?,
        _ => return None,
    };
    // Each entry takes two bytes at least: a count past the payload ends at its end.
    for _ in 0..entries {
        let key = reader.marker()?;
        if !is_str(key) {
            reader.skip_from(key)?;
            let value = reader.marker()?;
            reader.skip_from(value)?;
            continue;
        }
        let name = reader.str_bytes(key)?;
        let value = reader.marker()?;
        if name == field.as_bytes() {
            return is_str(value).then(|| reader.str_bytes(value)).flatten().and_then(|bytes| std::str::from_utf8(bytes).ok());
        }
        reader.skip_from(value)?;
    }
    None
}

fn is_str(marker: Marker) -> bool {
    matches!(marker, Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Option<&'a [u8]> {
        let end = self.at.checked_add(usize::try_from(n).ok()?)?;
        let taken = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(taken)
    }

    /// A big-endian unsigned integer of `n` bytes.
    fn uint(&mut self, n: u64) -> Option<u64> {
        Some(self.take(n)?.iter().fold(0, |value, byte| value << 8 | u64::from(*byte)))
    }

    fn marker(&mut self) -> Option<Marker> {
        Some(Marker::from_u8(self.take(1)?[0]))
    }

    /// The bytes of the string a `marker` starts ([`is_str`]); `None` when the payload ends first.
    fn str_bytes(&mut self, marker: Marker) -> Option<&'a [u8]> {
        let len = match marker {
            Marker::FixStr(n) => u64::from(n),
            Marker::Str8 => self.uint(1)?,
            Marker::Str16 => self.uint(2)?,
            Marker::Str32 => self.uint(4)?,
            _ => return None,
        };
        self.take(len)
    }

    /// Passes over the value a `marker` starts, and everything nested in it.
    fn skip_from(&mut self, marker: Marker) -> Option<()> {
        let mut pending: u64 = 1;
        let mut next = Some(marker);
        while pending > 0 {
            pending -= 1;
            let marker = match next.take() {
                Some(marker) => marker,
                None => self.marker()?,
            };
            let (bytes, values) = self.extent(marker)?;
            self.take(bytes)?;
            pending = pending.checked_add(values)?;
        }
        Some(())
    }

    /// What follows a marker: bytes to pass over, and how many values are nested in it.
    fn extent(&mut self, marker: Marker) -> Option<(u64, u64)> {
        Some(match marker {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0),
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (u64::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (self.uint(1)?, 0),
            Marker::Str16 | Marker::Bin16 => (self.uint(2)?, 0),
            Marker::Str32 | Marker::Bin32 => (self.uint(4)?, 0),
            Marker::FixArray(n) => (0, u64::from(n)),
            Marker::Array16 => (0, self.uint(2)?),
            Marker::Array32 => (0, self.uint(4)?),
            Marker::FixMap(n) => (0, 2 * u64::from(n)),
            Marker::Map16 => (0, 2 * self.uint(2)?),
            Marker::Map32 => (0, 2 * self.uint(4)?),
            // The type byte, then the data.
            Marker::FixExt1 => (2, 0),
            Marker::FixExt2 => (3, 0),
            Marker::FixExt4 => (5, 0),
            Marker::FixExt8 => (9, 0),
            Marker::FixExt16 => (17, 0),
            Marker::Ext8 => (self.uint(1)? + 1, 0),
            Marker::Ext16 => (self.uint(2)? + 1, 0),
            Marker::Ext32 => (self.uint(4)? + 1, 0),
            Marker::Reserved => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::top_level_str;

    fn packed(value: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    #[test]
    fn a_top_level_string_is_read_past_any_value() {
        let payload = packed(&serde_json::json!({
            "v": 1, "n": -300, "f": 1.5, "big": u64::MAX, "list": [1, [2, {"job_id": "inner"}], "x"],
            "map": {"a": null, "b": true}, "job_id": "ep1-s1", "shot_id": 7,
        }));
        assert_eq!(top_level_str(&payload, "job_id"), Some("ep1-s1"));
        assert_eq!(top_level_str(&payload, "shot_id"), None, "not a string");
        assert_eq!(top_level_str(&payload, "prompt"), None, "absent");
    }

    #[test]
    fn nesting_deeper_than_any_stack_costs_nothing_and_bad_bytes_end_the_read() {
        // {"x": [[[[...]]]] 100,000 deep, "job_id": "deep-1"}
        let mut payload = vec![0x82, 0xa1, b'x'];
        payload.extend(std::iter::repeat_n(0x91u8, 100_000));
        payload.push(0x90);
        payload.extend([0xa6, b'j', b'o', b'b', b'_', b'i', b'd', 0xa6, b'd', b'e', b'e', b'p', b'-', b'1']);
        assert_eq!(top_level_str(&payload, "job_id"), Some("deep-1"));
        // A map that says it holds four billion entries, a string longer than the payload, a
        // reserved marker, no map at all.
        assert_eq!(top_level_str(&[0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, b'a', 0x01], "job_id"), None);
        assert_eq!(top_level_str(&[0x81, 0xa6, b'j', b'o', b'b', b'_', b'i', b'd', 0xdb, 0xff, 0xff, 0xff, 0xff, b'a'], "job_id"), None);
        assert_eq!(top_level_str(&[0x81, 0xa1, b'a', 0xc1], "job_id"), None);
        assert_eq!(top_level_str(&[0x91, 0xa1, b'a'], "job_id"), None);
        assert_eq!(top_level_str(&[], "job_id"), None);
    }
}
