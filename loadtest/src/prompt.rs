//! Prompt text of a chosen size for an endpoint whose tokenizer we cannot see:
//! a fixed list of common words, a per-request permutation of it, and the
//! linear fit that turns two probes' `usage.prompt_tokens` into words per prompt.

use serde::Serialize;

/// 101 common English words. The count is prime so that every stride 1..=100
/// walks the whole list, which gives 101 × 100 distinct word orders.
pub const WORDS: [&str; 101] = [
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there",
    "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
    "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like",
    "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no",
    "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its",
    "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "over",
    "new", "sound",
];

/// Word counts of the two calibration probes: one and two whole passes over
/// [`WORDS`]. Whole passes contain every word equally often, so both the slope
/// (tokens per word) and the intercept (template overhead) are unbiased by
/// which words happen to be short; a 50-word probe of the most common words
/// underestimated the overhead.
pub const PROBE_WORDS: (usize, usize) = (WORDS.len(), 2 * WORDS.len());

/// A prompt of `words` words whose order depends on `index`: the start rotates
/// with the index and the stride changes every full rotation, so consecutive
/// requests do not share a prefix that a prefix cache could reuse.
pub fn build_prompt(words: usize, index: u64, out: &mut String) {
    let n = WORDS.len() as u64;
    let offset = index % n;
    let stride = 1 + (index / n) % (n - 1);
    out.clear();
    let mut pos = offset;
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        // pos < n, so the cast back to usize cannot truncate.
        out.push_str(WORDS[pos as usize]);
        pos = (pos + stride) % n;
    }
}

/// What the calibration probes learned about one model's tokenizer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// The model probed.
    pub model: String,
    /// Fitted prompt tokens per word of [`WORDS`].
    pub tokens_per_word: f64,
    /// Fitted fixed tokens (chat template, BOS) added to every prompt.
    pub overhead_tokens: f64,
    /// Words per prompt used in the run.
    pub prompt_words: usize,
    /// The two probes as (words, usage.prompt_tokens); empty when the ratio
    /// was given on the command line instead of probed.
    pub probes: Vec<(usize, u64)>,
}

impl Calibration {
    /// Fits `tokens = overhead + tokens_per_word × words` through two probes and
    /// picks the word count that lands nearest `target_tokens`.
    pub fn fit(
        model: &str,
        target_tokens: u32,
        (w1, t1): (usize, u64),
        (w2, t2): (usize, u64),
    ) -> anyhow::Result<Self> {
        let slope = (t2 as f64 - t1 as f64) / (w2 as f64 - w1 as f64);
        if !(slope.is_finite() && slope > 0.0) {
            anyhow::bail!(
                "prompt calibration for model {model:?}: usage.prompt_tokens did not grow with \
                 the prompt ({w1} words -> {t1} tokens, {w2} words -> {t2} tokens); \
                 pass --tokens-per-word to skip calibration"
            );
        }
        let overhead = (t1 as f64 - slope * w1 as f64).max(0.0);
        let mut c = Self::assumed(model, target_tokens, slope, overhead);
        c.probes = vec![(w1, t1), (w2, t2)];
        Ok(c)
    }

    /// Uses a given ratio without probing.
    pub fn assumed(model: &str, target_tokens: u32, tokens_per_word: f64, overhead: f64) -> Self {
        let words = ((f64::from(target_tokens) - overhead) / tokens_per_word).round();
        Self {
            model: model.to_string(),
            tokens_per_word,
            overhead_tokens: overhead,
            // Saturating float->int cast; at least one word so a prompt exists.
            prompt_words: (words as usize).max(1),
            probes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn prompts_vary_and_have_the_right_length() {
        let mut a = String::new();
        let mut b = String::new();
        build_prompt(30, 0, &mut a);
        build_prompt(30, 1, &mut b);
        assert_eq!(a.split(' ').count(), 30);
        assert_ne!(a, b);
        build_prompt(30, 101, &mut b);
        assert_ne!(a.split(' ').nth(1), b.split(' ').nth(1));
        build_prompt(0, 5, &mut a);
        assert!(a.is_empty());
    }

    #[test]
    fn one_full_pass_uses_every_word_once() {
        for index in [0, 7, 150, 5000] {
            let mut p = String::new();
            build_prompt(WORDS.len(), index, &mut p);
            let mut seen: Vec<&str> = p.split(' ').collect();
            seen.sort_unstable();
            let mut all = WORDS.to_vec();
            all.sort_unstable();
            assert_eq!(seen, all, "index {index}");
        }
    }

    #[test]
    fn fit_recovers_slope_and_overhead() {
        let c = Calibration::fit("m", 505, (50, 105), (151, 307)).unwrap();
        assert!((c.tokens_per_word - 2.0).abs() < 1e-9);
        assert!((c.overhead_tokens - 5.0).abs() < 1e-9);
        assert_eq!(c.prompt_words, 250);
        assert!(Calibration::fit("m", 500, (50, 80), (151, 80)).is_err());
        let tiny = Calibration::fit("m", 1, (50, 80), (151, 231)).unwrap();
        assert_eq!(tiny.prompt_words, 1);
    }
}
