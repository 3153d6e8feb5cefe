//! A principal's message policy (SPEC section 6): the quota window, the burst bucket and
//! the active-generation limit that the lifecycle admission enforces in one transaction.

use switchyard_actors::lifecycle::MessagePolicy;

use crate::auth::Principal;
use crate::config::Config;

/// The principal's message policy: what its key sets; otherwise a key (a team's service)
/// has no message quota, burst bucket or active-generation limit, and a JWT principal (a
/// person) gets the configured defaults (40 per 3 h, a bucket of 20 refilled one per 3 s)
/// and `jwt_max_streams` active generations.
pub fn policy(config: &Config, who: &Principal) -> MessagePolicy {
    let g = &config.generations;
    let person = who.key_id.is_none();
    let default = |value: u32| {
        if person {
            value
        } else {
            MessagePolicy::UNLIMITED
        }
    };
    let longest = config.timeouts.total_secs + config.timeouts.settle_wait_secs;
    MessagePolicy {
        limit: who.message_quota.unwrap_or(default(g.messages_per_window)),
        window_ms: i64::from(g.window_hours) * 3_600_000,
        burst_capacity: who.burst_capacity.unwrap_or(default(g.burst_capacity)),
        burst_refill_ms: i64::from(who.burst_refill_seconds.unwrap_or(g.burst_refill_secs)) * 1000,
        max_active: who.max_streams.unwrap_or(MessagePolicy::UNLIMITED),
        slot_ttl_ms: i64::try_from(longest.saturating_mul(1000)).unwrap_or(i64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn principal(key_id: Option<i64>) -> Principal {
        Principal {
            team_id: 1,
            key_id,
            subject: "s".into(),
            model_allowlist: None,
            rpm: None,
            max_streams: key_id.is_none().then_some(2),
            tokens_per_day: None,
            message_quota: None,
            burst_capacity: None,
            burst_refill_seconds: None,
            admin: false,
            service_tiers: Default::default(),
        }
    }

    #[test]
    fn keys_meter_no_messages_unless_set_and_people_get_the_defaults() {
        let config = Config::default();
        let service = policy(&config, &principal(Some(7)));
        assert!(!service.meters_messages());
        assert_eq!(service.max_active, MessagePolicy::UNLIMITED);
        let person = policy(&config, &principal(None));
        assert!(person.meters_messages());
        assert_eq!(
            (
                person.limit,
                person.burst_capacity,
                person.burst_refill_ms,
                person.max_active
            ),
            (40, 20, 3000, 2)
        );
        assert_eq!(person.window_ms, 3 * 3600 * 1000);
        let mut limited = principal(Some(7));
        limited.message_quota = Some(5);
        limited.max_streams = Some(3);
        let limited = policy(&config, &limited);
        assert!(limited.meters_messages());
        assert_eq!(
            (limited.limit, limited.burst_capacity, limited.max_active),
            (5, MessagePolicy::UNLIMITED, 3)
        );
    }
}
