//! The line of a model's waiting generations, and who goes next when its nodes are full.
//!
//! Work is counted in tokens (a [`Ticket`]'s cost: the prompt and the output it may make),
//! and shared by start-time fair queueing at two levels: between tiers by their weights, and
//! between the teams of one tier equally. Each level keeps a virtual clock; a lane (a tier, or
//! a team inside one) may start at the later of that clock and its own finish, and the lane
//! that may start earliest goes next, its finish moving on by the cost (divided by the tier's
//! weight, between tiers). So a team that sent 200 requests and one that sent 20 alternate
//! while both wait, a tier of weight 8 gets twice the tokens of one of weight 4, and a lane
//! that was idle starts level with the others rather than ahead by what it did not use. On
//! top, a tier with a minimum share builds credit with every dispatch while it has work
//! waiting and goes next whenever its credit reaches a whole dispatch, whatever the weights.
//!
//! A retry (a generation whose node was lost) goes before everything, and inside a lane the
//! order is arrival: a generation sent again to a new owner keeps its place among the others.
//! With the policy off ([`Policy::fair`] false) the whole line is one lane: arrival order.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::actor::Waiting;
use crate::tier::{Policy, Tier};

/// What a waiting generation is to the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Ticket {
    /// The tier it runs at.
    #[serde(default)]
    pub tier: Tier,
    /// The team paying for it: the teams of one tier share it equally.
    #[serde(default)]
    pub team: i64,
    /// Its work in tokens: its prompt and the most output it may make.
    #[serde(default)]
    pub cost: u64,
}

/// Where a waiter stands: among the retries, or in a team's lane of a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// Retries go first.
    Retry,
    /// A team's lane, by tier index and team.
    Team {
        /// [`Tier::index`] (always 0 with the policy off).
        tier: usize,
        /// The team (always 0 with the policy off).
        team: i64,
    },
}

/// The most credit a tier's minimum share saves up (two dispatches' worth).
const MAX_CREDIT: f64 = 2.0;

/// One team's lane of a tier.
#[derive(Debug, Default)]
struct TeamLane {
    /// Its finish on the tier's virtual clock.
    finish: f64,
    line: VecDeque<Waiting>,
}

/// One tier's part of the line.
#[derive(Debug, Default)]
struct Band {
    /// Its finish on the line's virtual clock.
    finish: f64,
    /// The tier's own virtual clock, between its teams.
    clock: f64,
    teams: BTreeMap<i64, TeamLane>,
    /// Waiters in its teams' lanes.
    waiting: usize,
    /// Dispatches its minimum share is owed.
    credit: f64,
}

impl Band {
    /// The team whose lane may start first (ties: the earlier head).
    fn next_team(&self) -> Option<i64> {
        self.teams
            .iter()
            .filter_map(|(team, lane)| {
                let head = lane.line.front()?;
                Some((lane.finish.max(self.clock), head.arrived, *team))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, _, team)| team)
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Line {
    policy: Policy,
    retries: VecDeque<Waiting>,
    bands: [Band; 3],
    /// The line's virtual clock, between tiers.
    clock: f64,
    len: usize,
    tokens: u64,
}

impl Line {
    pub(super) fn new(policy: Policy) -> Self {
        Self {
            policy,
            retries: VecDeque::new(),
            bands: Default::default(),
            clock: 0.0,
            len: 0,
            tokens: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokens of every waiter's work.
    pub(super) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The lane a ticket waits in.
    fn lane_of(&self, ticket: &Ticket) -> (usize, i64) {
        if self.policy.fair {
            (ticket.tier.index(), ticket.team)
        } else {
            (0, 0)
        }
    }

    /// Every waiter, retries first, then by tier and team.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Waiting> {
        self.retries.iter().chain(
            self.bands
                .iter()
                .flat_map(|b| b.teams.values().flat_map(|t| t.line.iter())),
        )
    }

    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.iter().any(|w| w.request_id == request_id)
    }

    /// Joins the line: a retry (`front`) before every other, anything else in its lane behind
    /// every waiter that arrived no later than it.
    pub(super) fn push(&mut self, w: Waiting, front: bool) {
        self.len += 1;
        self.tokens = self.tokens.saturating_add(w.ticket.cost);
        if front {
            self.retries.push_front(w);
            return;
        }
        let (tier, team) = self.lane_of(&w.ticket);
        let band = &mut self.bands[tier];
        let lane = band.teams.entry(team).or_default();
        let at = place_at(lane.line.iter().map(|w| w.arrived), w.arrived);
        lane.line.insert(at, w);
        band.waiting += 1;
    }

    /// Puts back, at the head of its lane, a waiter taken with [`Line::take`] uncharged (one
    /// passed over for this round): the waiters set aside go back in reverse order.
    pub(super) fn put_back(&mut self, lane: Lane, w: Waiting) {
        self.len += 1;
        self.tokens = self.tokens.saturating_add(w.ticket.cost);
        match lane {
            Lane::Retry => self.retries.push_front(w),
            Lane::Team { tier, team } => {
                let band = &mut self.bands[tier];
                band.teams.entry(team).or_default().line.push_front(w);
                band.waiting += 1;
            }
        }
    }

    /// The lane whose head goes next.
    pub(super) fn head(&self) -> Option<Lane> {
        if !self.retries.is_empty() {
            return Some(Lane::Retry);
        }
        let waiting = || (0..3).filter(|&i| self.bands[i].waiting > 0);
        let owed = waiting()
            .filter(|&i| self.bands[i].credit >= 1.0)
            .max_by(|&a, &b| self.bands[a].credit.total_cmp(&self.bands[b].credit));
        let tier = owed.or_else(|| {
            waiting().min_by(|&a, &b| {
                let start = |i: usize| self.bands[i].finish.max(self.clock);
                start(a).total_cmp(&start(b)).then(a.cmp(&b))
            })
        })?;
        let team = self.bands[tier].next_team()?;
        Some(Lane::Team { tier, team })
    }

    /// The waiters of `lane`, in the order they go.
    pub(super) fn lane(&self, lane: Lane) -> impl Iterator<Item = &Waiting> {
        let line = match lane {
            Lane::Retry => Some(&self.retries),
            Lane::Team { tier, team } => self.bands[tier].teams.get(&team).map(|t| &t.line),
        };
        line.into_iter().flatten()
    }

    /// The head of `lane`, to change.
    pub(super) fn head_mut(&mut self, lane: Lane) -> Option<&mut Waiting> {
        match lane {
            Lane::Retry => self.retries.front_mut(),
            Lane::Team { tier, team } => self.bands[tier].teams.get_mut(&team)?.line.front_mut(),
        }
    }

    /// Takes the waiter `at` places behind the head of `lane`. `charge`: it is dispatched, and
    /// its work counts against its tier and team; else it is only set aside.
    pub(super) fn take(&mut self, lane: Lane, at: usize, charge: bool) -> Option<Waiting> {
        let w = match lane {
            Lane::Retry => self.retries.remove(at)?,
            Lane::Team { tier, team } => {
                let band = &mut self.bands[tier];
                let w = band.teams.get_mut(&team)?.line.remove(at)?;
                band.waiting -= 1;
                w
            }
        };
        self.len -= 1;
        self.tokens = self.tokens.saturating_sub(w.ticket.cost);
        if charge {
            self.charge(&w.ticket);
        }
        Some(w)
    }

    /// Removes every waiter `gone` says is gone, and returns them.
    pub(super) fn remove_if(&mut self, mut gone: impl FnMut(&Waiting) -> bool) -> Vec<Waiting> {
        let mut out = Vec::new();
        let mut keep = |line: &mut VecDeque<Waiting>| {
            let (left, kept): (Vec<Waiting>, Vec<Waiting>) = line.drain(..).partition(&mut gone);
            *line = kept.into();
            let n = left.len();
            out.extend(left);
            n
        };
        keep(&mut self.retries);
        for band in &mut self.bands {
            for lane in band.teams.values_mut() {
                band.waiting -= keep(&mut lane.line);
            }
        }
        self.len -= out.len();
        let tokens: u64 = out.iter().map(|w| w.ticket.cost).sum();
        self.tokens = self.tokens.saturating_sub(tokens);
        self.prune();
        out
    }

    /// Every waiter, the line left empty (its clocks kept).
    pub(super) fn drain(&mut self) -> Vec<Waiting> {
        self.remove_if(|_| true)
    }

    /// One of `ticket`'s lane went to a node: the clocks move on by its work, and the minimum
    /// shares' credit by one dispatch.
    fn charge(&mut self, ticket: &Ticket) {
        let (tier, team) = self.lane_of(ticket);
        let cost = ticket.cost.max(1) as f64;
        for (i, band) in self.bands.iter_mut().enumerate() {
            let share = self.policy.tiers[i].min_share;
            band.credit = if share > 0.0 && (band.waiting > 0 || i == tier) {
                (band.credit + share).min(MAX_CREDIT)
            } else {
                0.0
            };
        }
        let weight = f64::from(self.policy.tiers[tier].weight.max(1));
        let band = &mut self.bands[tier];
        band.credit = (band.credit - 1.0).max(0.0);
        let start = band.finish.max(self.clock);
        self.clock = start;
        band.finish = start + cost / weight;
        let lane = band.teams.entry(team).or_default();
        let start = lane.finish.max(band.clock);
        band.clock = start;
        lane.finish = start + cost;
        self.prune();
    }

    /// Forgets the teams with nothing waiting whose finish the clock has passed: they would
    /// start level with the others anyway.
    fn prune(&mut self) {
        for band in &mut self.bands {
            let clock = band.clock;
            band.teams
                .retain(|_, lane| !lane.line.is_empty() || lane.finish > clock);
        }
    }

    /// Tokens of work served before a newcomer with `ticket` starts: the retries, its own
    /// team's waiting work, as much of each other team of its tier (they alternate), and of
    /// every other tier with work what its weight takes meanwhile (up to what it has).
    pub(super) fn work_ahead(&self, ticket: &Ticket) -> f64 {
        let tokens = |line: &VecDeque<Waiting>| -> u64 { line.iter().map(|w| w.ticket.cost).sum() };
        if !self.policy.fair {
            return self.tokens as f64;
        }
        let (tier, team) = self.lane_of(ticket);
        let band = &self.bands[tier];
        let own = band.teams.get(&team).map_or(0, |l| tokens(&l.line));
        let mut ahead = tokens(&self.retries) as f64 + own as f64;
        for (t, lane) in &band.teams {
            if *t != team {
                ahead += tokens(&lane.line).min(own) as f64;
            }
        }
        let in_tier = ahead;
        let weight = f64::from(self.policy.tiers[tier].weight.max(1));
        for (i, other) in self.bands.iter().enumerate() {
            if i != tier && other.waiting > 0 {
                let theirs: u64 = other.teams.values().map(|l| tokens(&l.line)).sum();
                let share = f64::from(self.policy.tiers[i].weight) / weight;
                ahead += (theirs as f64).min(in_tier.max(ticket.cost as f64) * share);
            }
        }
        ahead
    }

    /// Waiters by tier, in [`Tier::ALL`] order.
    pub(super) fn by_tier(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for w in self.iter() {
            n[w.ticket.tier.index()] += 1;
        }
        n
    }
}

/// Where in a lane whose waiters arrived at `arrivals` (in line order) one that arrived at
/// `arrived` goes: behind the last that came no later than it.
pub(super) fn place_at(
    mut arrivals: impl DoubleEndedIterator<Item = Instant> + ExactSizeIterator,
    arrived: Instant,
) -> usize {
    arrivals.rposition(|a| a <= arrived).map_or(0, |i| i + 1)
}

#[cfg(test)]
mod tests;
