//! A fixed generator of sentences with realistic lengths, for benchmarks: word counts are
//! log-normal (median 13 words, σ = 0.7 in log space, clamped to 1..=120), the words common
//! English ones plus some long, rare ones that split into several word pieces. 1,024 sentences
//! average about 20 tokens, as the sentences of a typical semantic-search corpus do; short
//! template sentences flatter a padded-bucket plan, these do not.
//!
//! Deterministic: the same `(n, seed)` gives the same sentences on every machine (its own
//! xorshift generator, no dependence on a random-number crate's version).

/// Words drawn uniformly; the last ones are long and split into several word pieces.
const WORDS: [&str; 112] = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "first",
    "one",
    "their",
    "its",
    "new",
    "after",
    "who",
    "they",
    "two",
    "but",
    "been",
    "more",
    "also",
    "other",
    "year",
    "time",
    "city",
    "world",
    "school",
    "people",
    "state",
    "music",
    "water",
    "house",
    "market",
    "river",
    "family",
    "government",
    "team",
    "season",
    "small",
    "large",
    "early",
    "later",
    "during",
    "between",
    "under",
    "several",
    "many",
    "local",
    "known",
    "used",
    "found",
    "made",
    "became",
    "called",
    "began",
    "played",
    "released",
    "published",
    "written",
    "built",
    "opened",
    "moved",
    "worked",
    "studied",
    "received",
    "station",
    "company",
    "history",
    "album",
    "series",
    "church",
    "village",
    "language",
    "system",
    "student",
    "country",
    "island",
    "north",
    "south",
    "western",
    "eastern",
    "national",
    "public",
    "general",
    "original",
    "important",
    "different",
    "university",
    "international",
    "approximately",
    "administrative",
    "characteristics",
    "infrastructure",
];

/// `n` sentences from `seed` (see the module docs).
pub fn realistic_sentences(n: usize, seed: u64) -> Vec<String> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut uniform = move || ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n)
        .map(|_| {
            // Box-Muller: one standard normal from two uniforms.
            let z = (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
            let words = (13f64.ln() + 0.7 * z).exp().round().clamp(1.0, 120.0) as usize;
            let mut s = String::new();
            for w in 0..words {
                let word = WORDS[(uniform() * WORDS.len() as f64) as usize % WORDS.len()];
                if w == 0 {
                    let mut c = word.chars();
                    if let Some(f) = c.next() {
                        s.extend(f.to_uppercase());
                        s.push_str(c.as_str());
                    }
                } else {
                    s.push(' ');
                    s.push_str(word);
                    if uniform() < 0.06 {
                        s.push(',');
                    }
                }
            }
            s.push('.');
            s
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_log_normal_around_13_words() {
        let s = realistic_sentences(1024, 1);
        assert_eq!(s, realistic_sentences(1024, 1));
        let mut words: Vec<usize> = s.iter().map(|x| x.split(' ').count()).collect();
        words.sort();
        let median = words[words.len() / 2];
        assert!((11..=15).contains(&median), "median {median}");
        assert!(
            *words.last().unwrap() >= 50,
            "tail {}",
            words.last().unwrap()
        );
        assert!(words[0] >= 1);
    }
}
