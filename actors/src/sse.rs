//! The one Server-Sent Events parser, shared by the node agent (the engine's stream) and the
//! load harness (the gateway's): incremental over a body's chunks, robust to anything a socket
//! does — events, lines and UTF-8 sequences split across reads (bytes are only handed out once
//! an event is whole), `\n`, `\r\n` and `\r` line ends, `:` comments — and bounded: a line or
//! an event over the parser's limit is an error, never a panic or an unbounded buffer.

/// The default bound on one event (pending line plus data), in bytes.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line or an event grew past the parser's bound.
    #[error("server-sent event over {limit} bytes")]
    EventTooLarge {
        /// The bound, in bytes.
        limit: usize,
    },
}

/// Push-style parser: feed it body chunks, receive each complete event's `data` (its `data:`
/// lines joined by `\n`, as the SSE spec says). Comments and fields other than `data`
/// (`event`, `id`, `retry`) are ignored; an event without a `data` field is not delivered.
#[derive(Debug)]
pub struct SseParser {
    /// Bytes of the line not yet terminated.
    line: Vec<u8>,
    /// `data` of the event being built.
    data: Vec<u8>,
    /// Whether the event being built has a `data` field (an empty one counts).
    has_data: bool,
    /// The last chunk ended on `\r`: a `\n` starting the next one belongs to that line end.
    skip_lf: bool,
    /// Largest line or event accepted.
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser that refuses lines and events larger than `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            skip_lf: false,
            max_event_bytes,
        }
    }

    /// Consumes one body chunk, calling `on_event` with the data of each event it completes.
    /// `on_event` returns `false` to stop early (the rest of the chunk is dropped); `feed`
    /// then returns `Ok(false)`.
    pub fn feed(
        &mut self,
        mut chunk: &[u8],
        mut on_event: impl FnMut(&[u8]) -> bool,
    ) -> Result<bool, SseError> {
        // An empty read says nothing about the `\r\n` pending across it.
        if self.skip_lf && !chunk.is_empty() {
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
            chunk = rest.get(1..).unwrap_or_default();
            if is_cr {
                match chunk.first() {
                    Some(b'\n') => chunk = chunk.get(1..).unwrap_or_default(),
                    None => self.skip_lf = true,
                    Some(_) => {}
                }
            }
            // A whole line with nothing pending is read straight from the chunk: the common
            // case copies nothing.
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

    /// Consumes `bytes`, appending the data of every completed event to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), SseError> {
        self.feed(bytes, |data| {
            out.push(data.to_vec());
            true
        })
        .map(|_| ())
    }

    /// End of stream: a last line or event without its terminator is still delivered
    /// (lenient: a truncated JSON payload then fails to parse, which the caller reports as a
    /// broken stream).
    pub fn finish(&mut self, out: &mut Vec<Vec<u8>>) -> Result<(), SseError> {
        let mut deliver = |data: &[u8]| {
            out.push(data.to_vec());
            true
        };
        self.skip_lf = false;
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, &mut deliver)?;
        }
        self.process_line(b"", &mut deliver).map(|_| ())
    }

    /// Whether bytes of an unfinished line or event are buffered: the body ended inside an
    /// event.
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data
    }

    fn too_large(&self) -> SseError {
        SseError::EventTooLarge {
            limit: self.max_event_bytes,
        }
    }

    fn push_line_bytes(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + self.data.len() + bytes.len() > self.max_event_bytes {
            return Err(self.too_large());
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn process_line(
        &mut self,
        line: &[u8],
        on_event: &mut impl FnMut(&[u8]) -> bool,
    ) -> Result<bool, SseError> {
        let Some(&first) = line.first() else {
            if !self.has_data {
                return Ok(true);
            }
            let keep_going = on_event(&self.data);
            self.data.clear();
            self.has_data = false;
            return Ok(keep_going);
        };
        if first == b':' {
            return Ok(true);
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = line.get(i + 1..).unwrap_or_default();
                (
                    line.get(..i).unwrap_or_default(),
                    v.strip_prefix(b" ").unwrap_or(v),
                )
            }
            None => (line, &[][..]),
        };
        if field != b"data" {
            return Ok(true);
        }
        if self.data.len() + value.len() + 1 > self.max_event_bytes {
            return Err(self.too_large());
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
    use proptest::prelude::*;

    use super::*;

    /// Feeds `input` in pieces of `piece` bytes, then ends the stream.
    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<Vec<u8>> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for chunk in input.chunks(piece) {
            p.push(chunk, &mut out).unwrap();
        }
        p.finish(&mut out).unwrap();
        out
    }

    fn collect(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn whole_events() {
        let ev = collect(&[b"data: {\"a\":1}\n\ndata: [DONE]\n\n"]);
        assert_eq!(ev, vec![b"{\"a\":1}".to_vec(), b"[DONE]".to_vec()]);
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
        for cut in 0..input.len() {
            assert_eq!(
                collect(&[&input[..cut], &input[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
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
    fn crlf_and_cr_line_ends_and_multi_line_data() {
        let input = b"data: a\r\ndata:b\r\n\r\nevent: x\rdata: c\r\r";
        for piece in 1..input.len() {
            let out = parse_in_pieces(input, piece);
            assert_eq!(out, vec![b"a\nb".to_vec(), b"c".to_vec()], "piece {piece}");
        }
        // A `\r\n` split between two reads is one line end, not two.
        let ev = collect(&[b"data: a\r\ndata:b\r", b"\n\r\ndata: c\r\rdata: d\n\n"]);
        assert_eq!(ev, vec![b"a\nb".to_vec(), b"c".to_vec(), b"d".to_vec()]);
    }

    #[test]
    fn comments_and_unknown_fields_are_ignored() {
        let out = parse_in_pieces(b": ping\nid: 3\nretry: 10\n\ndata: x\n\n", 5);
        assert_eq!(out, vec![b"x".to_vec()]);
        let ev = collect(&[b": ping\n\nevent: message\nid: 7\nretry: 10\n\n:x\ndata: a\n\n"]);
        assert_eq!(ev, vec![b"a".to_vec()]);
    }

    #[test]
    fn an_error_event_is_delivered() {
        let body =
            b"data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n";
        let ev = collect(&[&body[..30], &body[30..]]);
        assert_eq!(ev.len(), 2);
        let v: serde_json::Value = serde_json::from_slice(&ev[1]).unwrap();
        assert_eq!(v["error"]["code"], 500);
    }

    #[test]
    fn an_unterminated_last_event_is_delivered_at_eof() {
        let out = parse_in_pieces(b"data: [DONE]", 4);
        assert_eq!(out, vec![b"[DONE]".to_vec()]);
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

    #[test]
    fn a_line_over_the_bound_is_an_error_not_a_panic() {
        let too_large = Err(SseError::EventTooLarge { limit: 16 });
        let mut p = SseParser::new(16);
        assert_eq!(p.feed(&[b'x'; 10], |_| true), Ok(true));
        assert_eq!(p.feed(&[b'x'; 10], |_| true), too_large);
        let mut p = SseParser::new(16);
        let r = p.feed(b"data: 0123456789\ndata: 0123456789\n", |_| true);
        assert_eq!(r, too_large);
        // A whole over-long line in one chunk, terminated, is refused too.
        let mut p = SseParser::new(16);
        let mut out = Vec::new();
        let r = p.push(b"data: 0123456789abcdefghij\n\n", &mut out);
        assert_eq!(r, Err(SseError::EventTooLarge { limit: 16 }));
        assert!(out.is_empty());
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
        assert!(result.is_err());
        assert!(p.line.len() <= DEFAULT_MAX_EVENT_BYTES);
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

    proptest! {
        /// Any split of a stream into chunks, whatever its line ends, gives the same events.
        #[test]
        fn arbitrary_chunk_boundaries_give_the_same_events(
            events in proptest::collection::vec("[a-z{}\":é😀 ]{0,20}", 1..6),
            ends in proptest::collection::vec(0usize..3, 1..6),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..8),
        ) {
            let mut body = Vec::new();
            for (i, e) in events.iter().enumerate() {
                let end: &[u8] = [&b"\n"[..], b"\r\n", b"\r"][ends[i % ends.len()]];
                body.extend_from_slice(b": comment");
                body.extend_from_slice(end);
                for _ in 0..2 {
                    body.extend_from_slice(b"data: ");
                    body.extend_from_slice(e.as_bytes());
                    body.extend_from_slice(end);
                }
                body.extend_from_slice(end);
            }
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(body.len() + 1)).collect();
            points.sort_unstable();
            let mut p = SseParser::default();
            let mut out = Vec::new();
            let mut at = 0;
            for point in points.into_iter().chain([body.len()]) {
                p.push(&body[at..point], &mut out).unwrap();
                at = point;
            }
            p.finish(&mut out).unwrap();
            let expected: Vec<Vec<u8>> =
                events.iter().map(|e| format!("{e}\n{e}").into_bytes()).collect();
            prop_assert_eq!(out, expected);
        }
    }
}
