//! Incremental Server-Sent Events parsing over the byte chunks of an HTTP body.
//! Works on bytes, not `str`, so events and UTF-8 sequences split across network
//! reads reassemble before anything is decoded; the event size is bounded.

/// Largest event (sum of its `data:` lines) accepted; beyond it the stream is
/// treated as broken instead of buffering without bound.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 << 20;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseError {
    /// A line or an event grew past the parser's size limit.
    EventTooLarge,
}

impl std::fmt::Display for SseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SseError::EventTooLarge => f.write_str("event too large"),
        }
    }
}

impl std::error::Error for SseError {}

/// Push-style SSE parser: feed body chunks, receive each complete event's
/// `data` (lines joined by `\n`, as the SSE spec says). Comment lines (`:`)
/// and fields other than `data` are ignored. Buffers are reused across events.
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    // A chunk ended on '\r': a '\n' starting the next chunk belongs to it.
    skip_lf: bool,
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser that rejects events larger than `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::with_capacity(1024),
            data: Vec::with_capacity(1024),
            has_data: false,
            skip_lf: false,
            max_event_bytes,
        }
    }

    /// Consumes one body chunk, calling `on_event` with each event it completes.
    /// `on_event` returns `false` to stop early (the rest of the chunk is
    /// dropped); `feed` then returns `Ok(false)`.
    pub fn feed(
        &mut self,
        mut chunk: &[u8],
        mut on_event: impl FnMut(&[u8]) -> bool,
    ) -> Result<bool, SseError> {
        if self.skip_lf {
            self.skip_lf = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while !chunk.is_empty() {
            let Some(pos) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') else {
                self.push_line_bytes(chunk)?;
                break;
            };
            let (part, rest) = chunk.split_at(pos);
            let is_cr = rest.first() == Some(&b'\r');
            chunk = &rest[1..];
            if is_cr {
                match chunk.first() {
                    Some(b'\n') => chunk = &chunk[1..],
                    None => self.skip_lf = true,
                    Some(_) => {}
                }
            }
            // Complete lines are processed straight from the chunk when no
            // partial line is pending: the common case copies nothing.
            let keep_going = if self.line.is_empty() {
                self.process_line(part, &mut on_event)?
            } else {
                self.push_line_bytes(part)?;
                let line = std::mem::take(&mut self.line);
                let r = self.process_line(&line, &mut on_event);
                self.line = line;
                self.line.clear();
                r?
            };
            if !keep_going {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// True when bytes of an unfinished line or event are buffered, i.e. the
    /// body ended in the middle of an event.
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data
    }

    fn push_line_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.max_event_bytes {
            return Err(SseError::EventTooLarge);
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn process_line(
        &mut self,
        line: &[u8],
        on_event: &mut impl FnMut(&[u8]) -> bool,
    ) -> Result<bool, SseError> {
        if line.is_empty() {
            if !self.has_data {
                return Ok(true);
            }
            let keep_going = on_event(&self.data);
            self.data.clear();
            self.has_data = false;
            return Ok(keep_going);
        }
        if line[0] == b':' {
            return Ok(true);
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        if field != b"data" {
            return Ok(true);
        }
        if self.data.len() + value.len() + 1 > self.max_event_bytes {
            return Err(SseError::EventTooLarge);
        }
        if self.has_data {
            self.data.push(b'\n');
        }
        self.data.extend_from_slice(value);
        self.has_data = true;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn collect(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, |e| {
                out.push(e.to_vec());
                true
            })
            .unwrap();
        }
        out
    }

    #[test]
    fn whole_events() {
        let ev = collect(&[b"data: {\"a\":1}\n\ndata: [DONE]\n\n"]);
        assert_eq!(ev, vec![b"{\"a\":1}".to_vec(), b"[DONE]".to_vec()]);
    }

    #[test]
    fn event_split_at_every_byte() {
        let body = b"data: {\"x\":\"hello\"}\n\n: keep-alive\n\ndata: [DONE]\n\n";
        for cut in 0..body.len() {
            let ev = collect(&[&body[..cut], &body[cut..]]);
            assert_eq!(
                ev,
                vec![b"{\"x\":\"hello\"}".to_vec(), b"[DONE]".to_vec()],
                "cut at {cut}"
            );
        }
        let singles: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(collect(&singles).len(), 2);
    }

    #[test]
    fn utf8_split_across_reads() {
        let body = "data: {\"c\":\"h\u{e9}llo \u{1f600}\"}\n\n".as_bytes();
        let smile = body.iter().position(|&b| b == 0xF0).unwrap();
        for cut in [smile + 1, smile + 2, smile + 3] {
            let ev = collect(&[&body[..cut], &body[cut..]]);
            assert_eq!(ev.len(), 1);
            let s = std::str::from_utf8(&ev[0]).unwrap();
            assert_eq!(s, "{\"c\":\"h\u{e9}llo \u{1f600}\"}");
        }
    }

    #[test]
    fn comments_and_other_fields_ignored() {
        let ev = collect(&[b": ping\n\nevent: message\nid: 7\nretry: 10\n\n:x\ndata: a\n\n"]);
        assert_eq!(ev, vec![b"a".to_vec()]);
    }

    #[test]
    fn multi_line_data_and_crlf() {
        let ev = collect(&[b"data: a\r\ndata:b\r", b"\n\r\ndata: c\r\rdata: d\n\n"]);
        assert_eq!(ev, vec![b"a\nb".to_vec(), b"c".to_vec(), b"d".to_vec()]);
    }

    #[test]
    fn error_event_is_delivered() {
        let body =
            b"data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n";
        let ev = collect(&[&body[..30], &body[30..]]);
        assert_eq!(ev.len(), 2);
        let v: serde_json::Value = serde_json::from_slice(&ev[1]).unwrap();
        assert_eq!(v["error"]["code"], 500);
    }

    #[test]
    fn stop_early() {
        let mut p = SseParser::default();
        let mut n = 0;
        let r = p.feed(b"data: 1\n\ndata: 2\n\n", |_| {
            n += 1;
            false
        });
        assert_eq!(r, Ok(false));
        assert_eq!(n, 1);
    }

    #[test]
    fn oversized_line_is_an_error_not_a_panic() {
        let mut p = SseParser::new(16);
        let r = p.feed(&[b'x'; 10], |_| true);
        assert_eq!(r, Ok(true));
        assert_eq!(p.feed(&[b'x'; 10], |_| true), Err(SseError::EventTooLarge));
        let mut p = SseParser::new(16);
        let r = p.feed(b"data: 0123456789\ndata: 0123456789\n", |_| true);
        assert_eq!(r, Err(SseError::EventTooLarge));
    }

    #[test]
    fn partial_tail_is_reported() {
        let mut p = SseParser::default();
        p.feed(b"data: [DONE]\n\ndata: {\"a\"", |_| true).unwrap();
        assert!(p.has_partial());
        let mut p = SseParser::default();
        p.feed(b"data: x\n\n", |_| true).unwrap();
        assert!(!p.has_partial());
    }

    #[test]
    fn non_utf8_passes_through_as_bytes() {
        let ev = collect(&[b"data: \xff\xfe\n\n"]);
        assert_eq!(ev, vec![vec![0xff, 0xfe]]);
    }
}
