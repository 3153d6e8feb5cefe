//! A Server-Sent Events parser for the engine's stream, robust to anything a socket does:
//! events and lines split across reads (UTF-8 included: bytes are only decoded once an event
//! is whole), `\n`, `\r\n` and `\r` line ends, `:` comments, and unbounded lines (an event
//! over [`MAX_EVENT_BYTES`] is an error, which the caller treats as a broken stream).

/// Largest event (pending line plus data) accepted from the engine.
pub(crate) const MAX_EVENT_BYTES: usize = 1 << 20;

/// The event (or a line of it) is larger than [`MAX_EVENT_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("server-sent event over {MAX_EVENT_BYTES} bytes")]
pub(crate) struct EventTooLarge;

/// Incremental parser; feed it what the socket gives, collect the `data` of whole events.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    /// Bytes of the line not yet terminated.
    line: Vec<u8>,
    /// `data` of the event being built (lines joined with `\n`).
    data: Vec<u8>,
    /// Whether the event being built has a `data` field (an empty one counts).
    has_data: bool,
    /// The last byte seen was a `\r`; a `\n` right after it belongs to the same line end.
    skip_lf: bool,
}

impl SseParser {
    /// Consumes `bytes`, appending the data of every completed event to `out`.
    pub(crate) fn push(
        &mut self,
        mut bytes: &[u8],
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), EventTooLarge> {
        while !bytes.is_empty() {
            if self.skip_lf {
                self.skip_lf = false;
                if bytes[0] == b'\n' {
                    bytes = &bytes[1..];
                    continue;
                }
            }
            match bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(end) => {
                    self.grow_line(&bytes[..end])?;
                    self.skip_lf = bytes[end] == b'\r';
                    let line = std::mem::take(&mut self.line);
                    self.process_line(&line, out)?;
                    self.line = line;
                    self.line.clear();
                    bytes = &bytes[end + 1..];
                }
                None => {
                    self.grow_line(bytes)?;
                    bytes = &[];
                }
            }
        }
        Ok(())
    }

    /// End of stream: a last line or event without its terminator is still delivered (lenient:
    /// a truncated JSON payload then fails to parse, which is reported as a broken stream).
    pub(crate) fn finish(&mut self, out: &mut Vec<Vec<u8>>) -> Result<(), EventTooLarge> {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, out)?;
        }
        self.process_line(b"", out)
    }

    fn grow_line(&mut self, bytes: &[u8]) -> Result<(), EventTooLarge> {
        if self.line.len() + self.data.len() + bytes.len() > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), EventTooLarge> {
        if line.is_empty() {
            if self.has_data {
                self.has_data = false;
                out.push(std::mem::take(&mut self.data));
            }
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        // `event`, `id` and `retry` mean nothing to a chat completion stream.
        if field == b"data" {
            if self.data.len() + value.len() + 1 > MAX_EVENT_BYTES {
                return Err(EventTooLarge);
            }
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<Vec<u8>> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for chunk in input.chunks(piece) {
            p.push(chunk, &mut out).unwrap();
        }
        p.finish(&mut out).unwrap();
        out
    }

    #[test]
    fn events_split_anywhere_parse_the_same() {
        let input =
            "data: {\"a\":\"h\u{e9}llo \u{1F600}\"}\n\n: keep-alive\n\ndata: [DONE]\n\n".as_bytes();
        let whole = parse_in_pieces(input, input.len());
        assert_eq!(whole.len(), 2);
        assert_eq!(
            String::from_utf8(whole[0].clone()).unwrap(),
            "{\"a\":\"h\u{e9}llo \u{1F600}\"}"
        );
        assert_eq!(whole[1], b"[DONE]");
        for piece in 1..input.len() {
            assert_eq!(parse_in_pieces(input, piece), whole, "piece size {piece}");
        }
    }

    #[test]
    fn crlf_and_cr_line_ends_and_multi_line_data() {
        let input = b"data: a\r\ndata:b\r\n\r\nevent: x\rdata: c\r\r";
        for piece in 1..input.len() {
            let out = parse_in_pieces(input, piece);
            assert_eq!(out, vec![b"a\nb".to_vec(), b"c".to_vec()], "piece {piece}");
        }
    }

    #[test]
    fn comments_and_unknown_fields_are_ignored() {
        let out = parse_in_pieces(b": ping\nid: 3\nretry: 10\n\ndata: x\n\n", 5);
        assert_eq!(out, vec![b"x".to_vec()]);
    }

    #[test]
    fn an_unterminated_last_event_is_delivered_at_eof() {
        let out = parse_in_pieces(b"data: [DONE]", 4);
        assert_eq!(out, vec![b"[DONE]".to_vec()]);
    }

    #[test]
    fn huge_lines_are_refused_without_buffering_them() {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        let block = vec![b'x'; 64 * 1024];
        p.push(b"data: ", &mut out).unwrap();
        let mut result = Ok(());
        for _ in 0..20 {
            result = p.push(&block, &mut out);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(EventTooLarge));
        assert!(p.line.len() <= MAX_EVENT_BYTES);
    }

    #[test]
    fn many_data_lines_are_bounded_too() {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        let line = format!("data: {}\n", "y".repeat(1000));
        let mut failed = false;
        for _ in 0..2000 {
            if p.push(line.as_bytes(), &mut out).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
        assert!(out.is_empty());
    }
}
