//! Service tiers: OpenAI's `service_tier` (`priority`, `default`, `flex`; `auto` asks for the
//! principal's own default). A tier decides a request's share of a saturated model (its
//! weight, and the minimum share it keeps while it has work waiting), how long it may wait
//! for a node (its budget), and its place in the engine's own scheduler (vLLM's `priority`).
//! The policy is configuration ([`Policy`]); which tiers a principal may use is its
//! credential's ([`Allowed`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A service tier, in order of precedence (the first is served first by the engine).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Interactive work that pays for precedence.
    Priority,
    /// Everything else, unless its principal says otherwise.
    #[default]
    Default,
    /// Work that can wait: batch jobs, evaluations, the free tier.
    Flex,
}

impl Tier {
    /// Every tier, in order of precedence.
    pub const ALL: [Tier; 3] = [Tier::Priority, Tier::Default, Tier::Flex];

    /// Its name in the API (`service_tier`).
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Priority => "priority",
            Tier::Default => "default",
            Tier::Flex => "flex",
        }
    }

    /// Its position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        match self {
            Tier::Priority => 0,
            Tier::Default => 1,
            Tier::Flex => 2,
        }
    }

    /// vLLM's `priority` request field under `--scheduling-policy priority`: lower values are
    /// scheduled first, and preempt higher ones when the cache is full.
    pub fn engine_priority(self) -> i32 {
        match self {
            Tier::Priority => 0,
            Tier::Default => 1,
            Tier::Flex => 2,
        }
    }

    /// The tier a `service_tier` value names; `None` for `auto` (the principal's default).
    pub fn parse(value: &str) -> Result<Option<Tier>, UnknownTier> {
        match value {
            "auto" => Ok(None),
            "priority" => Ok(Some(Tier::Priority)),
            "default" => Ok(Some(Tier::Default)),
            "flex" => Ok(Some(Tier::Flex)),
            _ => Err(UnknownTier),
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `service_tier` value that names no tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("service_tier must be one of auto, default, flex, priority")]
pub struct UnknownTier;

/// The tiers a principal may use, and the one it gets when it names none (or `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    /// By [`Tier::index`].
    tiers: [bool; 3],
    default: Tier,
}

impl Allowed {
    /// `tiers` (at least one; in any order, duplicates ignored) with `default` among them.
    pub fn new(tiers: &[Tier], default: Tier) -> Result<Self, &'static str> {
        let mut allowed = [false; 3];
        for t in tiers {
            allowed[t.index()] = true;
        }
        if !allowed[default.index()] {
            return Err("the default service tier must be one of the allowed tiers");
        }
        Ok(Self {
            tiers: allowed,
            default,
        })
    }

    /// One tier only.
    pub fn only(tier: Tier) -> Self {
        let mut tiers = [false; 3];
        tiers[tier.index()] = true;
        Self {
            tiers,
            default: tier,
        }
    }

    /// The tiers, in order of precedence.
    pub fn tiers(&self) -> Vec<Tier> {
        Tier::ALL
            .into_iter()
            .filter(|t| self.tiers[t.index()])
            .collect()
    }

    /// Whether it may use `tier`.
    pub fn allows(&self, tier: Tier) -> bool {
        self.tiers[tier.index()]
    }

    /// The tier it gets by default.
    pub fn default_tier(&self) -> Tier {
        self.default
    }

    /// The tier a request asking for `requested` runs at: the one asked for when allowed,
    /// the default for `auto` or nothing, and the best allowed tier for one it lacks.
    pub fn resolve(&self, requested: Option<Tier>) -> Tier {
        match requested {
            None => self.default,
            Some(t) if self.allows(t) => t,
            Some(_) => Tier::ALL
                .into_iter()
                .find(|t| self.allows(*t))
                .unwrap_or(self.default),
        }
    }
}

impl Default for Allowed {
    fn default() -> Self {
        Self {
            tiers: [false, true, true],
            default: Tier::Default,
        }
    }
}

/// One tier's policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierPolicy {
    /// Its share of a saturated model against the other tiers with work waiting.
    pub weight: u32,
    /// The longest it waits for a node: a request predicted to start later is refused at
    /// once, and one still waiting at its budget leaves with `capacity_exhausted`.
    pub budget: Duration,
    /// The least fraction of dispatches it gets while it has work waiting, whatever the
    /// weights say (0 for none).
    pub min_share: f64,
}

/// How a saturated model's waiting work is ordered.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Each tier's policy, in [`Tier::ALL`] order.
    pub tiers: [TierPolicy; 3],
    /// Weighted fair queueing between tiers and between teams inside one (the default);
    /// `false` serves in arrival order (the benchmark's baseline).
    pub fair: bool,
}

impl Policy {
    /// The policy of `tier`.
    pub fn of(&self, tier: Tier) -> &TierPolicy {
        &self.tiers[tier.index()]
    }

    /// Every tier with the same budget and weight, in arrival order: a queue as it was
    /// before tiers (tests of other things).
    pub fn fifo(budget: Duration) -> Self {
        let same = TierPolicy {
            weight: 1,
            budget,
            min_share: 0.0,
        };
        Self {
            tiers: [same; 3],
            fair: false,
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            tiers: [
                TierPolicy {
                    weight: 8,
                    budget: Duration::from_secs(15),
                    min_share: 0.0,
                },
                TierPolicy {
                    weight: 4,
                    budget: Duration::from_secs(30),
                    min_share: 0.0,
                },
                TierPolicy {
                    weight: 1,
                    budget: Duration::from_secs(120),
                    min_share: 0.10,
                },
            ],
            fair: true,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn auto_and_nothing_get_the_default_and_a_missing_tier_the_best_allowed() {
        let a = Allowed::new(&[Tier::Flex, Tier::Default], Tier::Flex).unwrap();
        assert_eq!(a.resolve(None), Tier::Flex);
        assert_eq!(a.resolve(Some(Tier::Default)), Tier::Default);
        assert_eq!(a.resolve(Some(Tier::Priority)), Tier::Default);
        assert_eq!(
            Allowed::only(Tier::Flex).resolve(Some(Tier::Priority)),
            Tier::Flex
        );
        assert!(Allowed::new(&[Tier::Flex], Tier::Default).is_err());
    }

    #[test]
    fn the_api_names_parse_and_nothing_else_does() {
        for t in Tier::ALL {
            assert_eq!(Tier::parse(t.as_str()), Ok(Some(t)));
        }
        assert_eq!(Tier::parse("auto"), Ok(None));
        assert_eq!(Tier::parse("scale"), Err(UnknownTier));
        assert_eq!(Tier::parse("Priority"), Err(UnknownTier));
    }
}
