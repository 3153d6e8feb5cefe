//! The SSRF guard: a request body that references a URL the platform (or an engine with
//! tool or image fetching) could be made to call inside the network is refused with 422
//! `unsafe_reference` before anything is reserved. Checked: every `url`-like field (`url`,
//! `*_url`, `uri`, `href`, `endpoint`) anywhere in the body, and every URL-shaped string
//! inside tool definitions and tool calls. Conversation text is not: a developer asking
//! about `http://localhost:3000` is not making the platform fetch it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::Value;

/// Hostnames of cloud metadata services and the like.
const BLOCKED_HOSTS: &[&str] = &[
    "localhost",
    "metadata.google.internal",
    "metadata",
    "instance-data",
];
/// Deepest nesting inspected; deeper bodies are refused as malformed.
const MAX_DEPTH: usize = 64;

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsafe {
    /// The URL (scheme and host only, never the path) and the reason.
    Reference(String),
    /// Nested deeper than anyone sends.
    TooDeep,
}

/// [`check`] as the API's answer: 422 `unsafe_reference`.
pub fn guard(body: &Value) -> Result<(), crate::http::error::ApiError> {
    use switchyard_actors::error::ErrorCode;
    check(body).map_err(|unsafe_ref| {
        let message = match unsafe_ref {
            Unsafe::Reference(what) => {
                format!("The request references an internal resource ({what}).")
            }
            Unsafe::TooDeep => "The request body is nested too deeply.".to_owned(),
        };
        crate::http::error::ApiError::new(ErrorCode::UnsafeReference, message)
    })
}

/// The first unsafe reference in `body`, if any.
pub fn check(body: &Value) -> Result<(), Unsafe> {
    walk(body, Field::Other, false, 0)
}

/// What kind of field a value sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// A field that names a resource to fetch.
    Url,
    /// Anything else.
    Other,
}

fn field_kind(key: &str) -> Field {
    let k = key.to_ascii_lowercase();
    if matches!(k.as_str(), "url" | "uri" | "href" | "endpoint")
        || k.ends_with("_url")
        || k.ends_with("_uri")
    {
        Field::Url
    } else {
        Field::Other
    }
}

/// Subtrees whose strings a tool-using engine may act on.
fn is_tool_key(key: &str) -> bool {
    matches!(
        key,
        "tools" | "functions" | "tool_calls" | "function_call" | "tool_choice"
    )
}

fn walk(v: &Value, field: Field, in_tools: bool, depth: usize) -> Result<(), Unsafe> {
    if depth > MAX_DEPTH {
        return Err(Unsafe::TooDeep);
    }
    match v {
        Value::String(s) if field == Field::Url => check_string(s, true),
        Value::String(s) if in_tools => check_string(s, false),
        Value::String(_) => Ok(()),
        Value::Array(items) => items
            .iter()
            .try_for_each(|i| walk(i, field, in_tools, depth + 1)),
        Value::Object(map) => map
            .iter()
            .try_for_each(|(k, v)| walk(v, field_kind(k), in_tools || is_tool_key(k), depth + 1)),
        _ => Ok(()),
    }
}

fn check_string(s: &str, is_url_field: bool) -> Result<(), Unsafe> {
    // Free text is only inspected where it contains something URL-shaped.
    let candidates: Vec<&str> = if is_url_field {
        vec![s.trim()]
    } else {
        s.split(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '(' | ')'))
            .filter(|w| w.contains("://"))
            .collect()
    };
    for c in candidates {
        check_url(c)?;
    }
    Ok(())
}

fn check_url(u: &str) -> Result<(), Unsafe> {
    let Some((scheme, rest)) = u.split_once(':') else {
        return Ok(());
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme == "data" {
        return Ok(()); // inline content: nothing is fetched
    }
    if scheme != "http" && scheme != "https" {
        return Err(Unsafe::Reference(format!("{scheme}: scheme not allowed")));
    }
    let authority = rest
        .trim_start_matches('/')
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    let host_port = authority.rsplit('@').next().unwrap_or_default();
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        host_port.split(':').next().unwrap_or_default()
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let refuse = |why: &str| Err(Unsafe::Reference(format!("{scheme}://{host}: {why}")));
    if host.is_empty() {
        return refuse("no host");
    }
    if BLOCKED_HOSTS.contains(&host.as_str())
        || host.ends_with(".localhost")
        || host.ends_with(".internal")
    {
        return refuse("internal host");
    }
    if let Some(ip) = parse_ip(&host)
        && !is_public(ip)
    {
        return refuse("internal address");
    }
    Ok(())
}

/// Every form a resolver accepts counts: IPv6, dotted quads, and the `inet_aton` shorthands
/// (`127.1`, `2130706433`, octal `0177.0.0.1`, hex `0x7f000001`).
fn parse_ip(host: &str) -> Option<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(ip);
    }
    let parts: Vec<u32> = host.split('.').map(parse_part).collect::<Option<_>>()?;
    let n = match parts.as_slice() {
        [a] => *a,
        [a, b] if *a < 256 && *b < (1 << 24) => (a << 24) | b,
        [a, b, c] if *a < 256 && *b < 256 && *c < (1 << 16) => (a << 24) | (b << 16) | c,
        [a, b, c, d] if [a, b, c, d].iter().all(|p| **p < 256) => {
            (a << 24) | (b << 16) | (c << 8) | d
        }
        _ => return None,
    };
    Some(IpAddr::V4(Ipv4Addr::from(n)))
}

fn parse_part(p: &str) -> Option<u32> {
    if let Some(hex) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16).ok()
    } else if p.len() > 1 && p.starts_with('0') {
        u32::from_str_radix(&p[1..], 8).ok()
    } else if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) {
        p.parse().ok()
    } else {
        None
    }
}

fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        // Mapped (::ffff:a.b.c.d) and the deprecated compatible (::a.b.c.d) forms reach
        // the IPv4 address they carry.
        IpAddr::V6(v6) => match v6
            .to_ipv4_mapped()
            .or_else(|| v6.to_ipv4().filter(|_| v6.segments()[..6] == [0; 6]))
        {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    !(ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local() // 169.254/16, the metadata service among them
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || o[0] == 0
        || (o[0] == 100 && (64..128).contains(&o[1])) // carrier-grade NAT
        || (o[0] == 198 && (o[1] == 18 || o[1] == 19)) // benchmarking
        || o[0] >= 240)
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (s[0] & 0xfe00) == 0xfc00 // unique local
        || (s[0] & 0xffc0) == 0xfe80 // link local
        || s[0] == 0xfd00)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(v: Value) -> bool {
        check(&v).is_err()
    }

    #[test]
    fn internal_references_are_refused_wherever_they_hide() {
        for url in [
            "http://127.0.0.1/x",
            "http://localhost:8080/",
            "http://10.1.2.3/",
            "https://192.168.0.1",
            "http://172.16.5.4/",
            "http://169.254.169.254/latest/meta-data/",
            "http://metadata.google.internal/computeMetadata/v1/",
            "http://[::1]/",
            "http://[fd00::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://2130706433/",
            "http://0x7f000001/",
            "http://127.1/",
            "http://0177.0.0.1/",
            "http://[::127.0.0.1]/",
            "http://224.0.0.1/",
            "http://user@127.0.0.1/",
            "file:///etc/passwd",
            "gopher://example.com/",
            "ftp://example.com/",
        ] {
            let body = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]});
            assert!(refused(body), "{url}");
        }
        assert!(refused(
            json!({"tools": [{"function": {"parameters": {"endpoint": "see http://10.0.0.1/admin please"}}}]})
        ));
        assert!(refused(
            json!({"tools": [{"function": {"description": "calls http://10.0.0.1/admin"}}]})
        ));
        let call = json!({"tool_calls": [{"function": {"arguments": "{\"target\": \"http://169.254.169.254/\"}"}}]});
        assert!(refused(call));
    }

    #[test]
    fn public_urls_inline_data_and_plain_text_pass() {
        assert!(!refused(
            json!({"messages": [{"role": "user", "content": "read https://example.com/a?b=c and 10.0.0.1"}]})
        ));
        assert!(!refused(
            json!({"image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}})
        ));
        assert!(!refused(json!({"url": "https://8.8.8.8/"})));
        let question = json!({"messages": [{"role": "user", "content": "why does http://localhost:3000 refuse me?"}]});
        assert!(!refused(question), "conversation text is not fetched");
        assert!(!refused(
            json!({"messages": [{"role": "user", "content": "ratio 3:2, time 10:30"}]})
        ));
    }

    #[test]
    fn pathological_nesting_is_refused_not_overflowed() {
        let mut v = json!("x");
        for _ in 0..200 {
            v = json!([v]);
        }
        assert_eq!(check(&v), Err(Unsafe::TooDeep));
    }
}
