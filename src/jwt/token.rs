//! The parts of a token read without trusting it (the header, to pick a key and refuse an
//! algorithm before any key is touched) and the claims read after the signature checked out.

use serde::Deserialize;
use serde_json::{Map, Value};
use switchyard_actors::tier::Tier;

use super::{Claims, JwtError, Role};

/// Longer bearer strings are refused unread: real ID/access tokens are a few KiB.
pub(super) const MAX_TOKEN_LEN: usize = 16 * 1024;

/// The header fields needed before verification.
#[derive(Debug, Deserialize)]
pub(super) struct RawHeader {
    /// Kept as a string so `none` and unknown names become `AlgorithmNotAllowed`,
    /// not a parse failure.
    pub(super) alg: String,
    #[serde(default)]
    pub(super) kid: Option<String>,
    /// RFC 7515 §4.1.11: extensions we do not understand must make us reject the token.
    #[serde(default)]
    pub(super) crit: Option<Vec<String>>,
}

/// Splits the compact serialization and decodes the header. The signature may be empty
/// here (an `alg: none` token has one) so that such tokens get the precise error.
pub(super) fn parse_header(token: &str) -> Result<RawHeader, JwtError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(JwtError::Malformed);
    }
    let mut parts = token.split('.');
    let (Some(header), Some(_payload), Some(_signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtError::Malformed);
    };
    let bytes = b64url_decode(header).ok_or(JwtError::Malformed)?;
    let header: RawHeader = serde_json::from_slice(&bytes).map_err(|_| JwtError::Malformed)?;
    if header.crit.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err(JwtError::Malformed);
    }
    Ok(header)
}

/// Unpadded base64url (RFC 7515 §2), the only alphabet a JWT segment may use.
pub(super) fn b64url_decode(input: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(input)
        .ok()
}

/// Turns verified claims into [`Claims`], enforcing `exp` (required) and `nbf` against
/// `now` (Unix seconds) with `leeway`. `aud` and `iss` were checked by the decoder.
pub(super) fn claims_from(
    claims: &Map<String, Value>,
    now: i64,
    leeway: u64,
) -> Result<Claims, JwtError> {
    let leeway = i64::try_from(leeway).unwrap_or(i64::MAX);
    let exp = match claims.get("exp") {
        Some(v) => numeric_date(v).ok_or(JwtError::Malformed)?,
        None => return Err(JwtError::Malformed),
    };
    // RFC 7519 §4.1.4: not acceptable on or after `exp`.
    if now >= exp.saturating_add(leeway) {
        return Err(JwtError::Expired);
    }
    if let Some(nbf) = claims.get("nbf") {
        let nbf = numeric_date(nbf).ok_or(JwtError::Malformed)?;
        if nbf > now.saturating_add(leeway) {
            return Err(JwtError::Expired);
        }
    }
    let sub = claims
        .get("sub")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or(JwtError::Malformed)?
        .to_owned();
    let team = match claims.get("team") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => Some(s.clone()),
        // Team ids are integers in the store; some issuers emit them as JSON numbers.
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        Some(_) => return Err(JwtError::Malformed),
    };
    let role = match claims.get("role") {
        None | Some(Value::Null) => Role::User,
        Some(Value::String(s)) if s == "admin" => Role::Admin,
        Some(Value::String(s)) if s == "user" => Role::User,
        // An unrecognised role is a misconfigured issuer; refusing beats guessing.
        Some(_) => return Err(JwtError::Malformed),
    };
    let (service_tiers, service_tier) = tier_claims(claims)?;
    Ok(Claims {
        sub,
        team,
        role,
        exp,
        service_tiers,
        service_tier,
    })
}

/// `service_tiers` (an array of tier names) and `service_tier` (the default among them):
/// absent or null, the configured defaults apply; anything else that names no tier is a
/// misconfigured issuer, refused like an unknown role.
fn tier_claims(claims: &Map<String, Value>) -> Result<(Option<Vec<Tier>>, Option<Tier>), JwtError> {
    let tier = |v: &Value| {
        v.as_str()
            .and_then(|s| Tier::parse(s).ok().flatten())
            .ok_or(JwtError::Malformed)
    };
    let tiers = match claims.get("service_tiers") {
        None | Some(Value::Null) => None,
        Some(Value::Array(names)) if !names.is_empty() => {
            Some(names.iter().map(tier).collect::<Result<Vec<_>, _>>()?)
        }
        Some(_) => return Err(JwtError::Malformed),
    };
    let default = match claims.get("service_tier") {
        None | Some(Value::Null) => None,
        Some(v) => Some(tier(v)?),
    };
    Ok((tiers, default))
}

/// A NumericDate (RFC 7519 §2): seconds, possibly fractional.
fn numeric_date(v: &Value) -> Option<i64> {
    if let Some(i) = v.as_i64() {
        return Some(i);
    }
    if v.as_u64().is_some() {
        return Some(i64::MAX);
    }
    let f = v.as_f64().filter(|f| f.is_finite())?;
    // Saturating float-to-int conversion; fractions are dropped.
    Some(f.floor() as i64)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use serde_json::json;

    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn jwt_b64url_decodes_unpadded_segments() {
        assert_eq!(b64url_decode("").unwrap(), b"");
        assert_eq!(b64url_decode("Zg").unwrap(), b"f");
        assert_eq!(b64url_decode("Zm8").unwrap(), b"fo");
        assert_eq!(b64url_decode("Zm9v").unwrap(), b"foo");
        assert_eq!(b64url_decode("-_8").unwrap(), [0xfb, 0xff]);
        assert!(b64url_decode("Zm9v=").is_none());
        assert!(b64url_decode("Zm9vY").is_none());
        assert!(b64url_decode("Zm+v").is_none());
    }

    #[test]
    fn jwt_header_keeps_unknown_algorithms_as_text() {
        // {"alg":"none","typ":"JWT"}
        let h = parse_header("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.e30.").unwrap();
        assert_eq!(h.alg, "none");
        assert!(h.kid.is_none());
    }

    #[test]
    fn jwt_header_rejects_garbage_and_crit() {
        assert_eq!(parse_header("abc").unwrap_err(), JwtError::Malformed);
        assert_eq!(parse_header("a.b.c.d").unwrap_err(), JwtError::Malformed);
        assert_eq!(parse_header("!!.e30.x").unwrap_err(), JwtError::Malformed);
        let long = "a".repeat(MAX_TOKEN_LEN + 1);
        assert_eq!(parse_header(&long).unwrap_err(), JwtError::Malformed);
        // {"alg":"RS256","crit":["exp"]}
        let crit = "eyJhbGciOiJSUzI1NiIsImNyaXQiOlsiZXhwIl19.e30.x";
        assert_eq!(parse_header(crit).unwrap_err(), JwtError::Malformed);
    }

    #[test]
    fn jwt_claims_accept_string_or_integer_team() {
        let c = claims_from(&map(json!({"sub": "u", "team": 42, "exp": 100})), 0, 0).unwrap();
        assert_eq!(c.team.as_deref(), Some("42"));
        assert_eq!(c.role, Role::User);
        let c = claims_from(
            &map(json!({"sub": "u", "team": "ml", "role": "admin", "exp": 100})),
            0,
            0,
        )
        .unwrap();
        assert_eq!(c.team.as_deref(), Some("ml"));
        assert_eq!(c.role, Role::Admin);
        assert_eq!(c.exp, 100);
        let bad = map(json!({"sub": "u", "team": 1.5, "exp": 100}));
        assert_eq!(claims_from(&bad, 0, 0).unwrap_err(), JwtError::Malformed);
        let bad = map(json!({"sub": "u", "role": "root", "exp": 100}));
        assert_eq!(claims_from(&bad, 0, 0).unwrap_err(), JwtError::Malformed);
        let bad = map(json!({"team": "ml", "exp": 100}));
        assert_eq!(claims_from(&bad, 0, 0).unwrap_err(), JwtError::Malformed);
    }

    #[test]
    fn jwt_tier_claims_name_tiers_or_the_token_is_refused() {
        let c = claims_from(
            &map(json!({"sub": "u", "exp": 100,
                "service_tiers": ["default", "flex"], "service_tier": "default"})),
            0,
            0,
        )
        .unwrap();
        assert_eq!(c.service_tiers, Some(vec![Tier::Default, Tier::Flex]));
        assert_eq!(c.service_tier, Some(Tier::Default));
        let c = claims_from(&map(json!({"sub": "u", "exp": 100})), 0, 0).unwrap();
        assert_eq!((c.service_tiers, c.service_tier), (None, None));
        for bad in [
            json!({"service_tiers": ["gold"]}),
            json!({"service_tiers": []}),
            json!({"service_tiers": "flex"}),
            json!({"service_tier": "auto"}),
            json!({"service_tier": 1}),
        ] {
            let mut claims = map(json!({"sub": "u", "exp": 100}));
            claims.extend(map(bad.clone()));
            assert_eq!(
                claims_from(&claims, 0, 0).unwrap_err(),
                JwtError::Malformed,
                "{bad}"
            );
        }
    }

    #[test]
    fn jwt_claims_enforce_exp_and_nbf_with_leeway() {
        let c = map(json!({"sub": "u", "exp": 100}));
        assert!(claims_from(&c, 99, 0).is_ok());
        assert_eq!(claims_from(&c, 100, 0).unwrap_err(), JwtError::Expired);
        assert!(claims_from(&c, 129, 30).is_ok());
        assert_eq!(claims_from(&c, 130, 30).unwrap_err(), JwtError::Expired);
        let no_exp = map(json!({"sub": "u"}));
        assert_eq!(claims_from(&no_exp, 0, 0).unwrap_err(), JwtError::Malformed);
        let float_exp = map(json!({"sub": "u", "exp": 100.7}));
        assert_eq!(claims_from(&float_exp, 0, 0).unwrap().exp, 100);
        let nbf = map(json!({"sub": "u", "exp": 1000, "nbf": 500}));
        assert_eq!(claims_from(&nbf, 400, 30).unwrap_err(), JwtError::Expired);
        assert!(claims_from(&nbf, 480, 30).is_ok());
    }
}
