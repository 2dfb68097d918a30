//! Prompt lookup ("ngram") proposals over a request's own token history.
//!
//! Find the longest suffix n-gram, `min_n <= n <= max_n`, that occurred earlier
//! in the history; propose the (up to `k`) tokens that followed its most recent
//! earlier occurrence. Empty proposal when nothing matches.
//!
//! Algorithm, O(len): reverse the history, so that the suffix becomes a prefix and
//! "an occurrence ending at e" becomes "position len - e of the reversed history".
//! The Z-function z[i] of the reversed history is then the length of the longest
//! suffix that ends at e = len - i. Scanning i = 1, 2, ... visits occurrences from
//! the most recent backwards; the first i reaching the longest length wins, and the
//! scan stops early as soon as a match of `max_n` is found.

/// Reusable scratch so repeated proposals do not allocate.
#[derive(Debug, Default)]
pub struct NgramScratch {
    z: Vec<u32>,
}

/// The proposal for `tokens` (a sub-slice of `tokens`, possibly empty).
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    propose_with(&mut NgramScratch::default(), tokens, min_n, max_n, k)
}

/// `propose` with caller-provided scratch.
pub fn propose_with<'a>(
    scratch: &mut NgramScratch,
    tokens: &'a [u32],
    min_n: usize,
    max_n: usize,
    k: usize,
) -> &'a [u32] {
    let len = tokens.len();
    let min_n = min_n.max(1);
    if k == 0 || max_n < min_n || len < min_n + 1 {
        return &[];
    }
    // rev(j) = j-th token of the reversed history.
    let rev = |j: usize| tokens[len - 1 - j];
    let z = &mut scratch.z;
    z.clear();
    z.resize(len, 0);
    let (mut l, mut r) = (0usize, 0usize); // rightmost Z-box [l, r)
    let (mut best_len, mut best_i) = (0usize, 0usize);
    for i in 1..len {
        let mut zi = if i < r {
            (r - i).min(z[i - l] as usize)
        } else {
            0
        };
        while i + zi < len && rev(zi) == rev(i + zi) {
            zi += 1;
        }
        if i + zi > r {
            l = i;
            r = i + zi;
        }
        z[i] = zi as u32;
        let m = zi.min(max_n);
        if m > best_len {
            best_len = m;
            best_i = i;
            if m == max_n {
                break;
            }
        }
    }
    if best_len < min_n {
        return &[];
    }
    let end = len - best_i; // exclusive end of the matched occurrence; < len
    &tokens[end..(end + k).min(len)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_most_recent_match() {
        // suffix [1, 2] occurred at 0 (followed by 3) and at 4 (followed by 9)
        let t = [1, 2, 3, 5, 1, 2, 9, 8, 1, 2];
        assert_eq!(propose(&t, 1, 2, 3), &[9, 8, 1]);
    }

    #[test]
    fn prefers_the_longest_suffix_over_the_most_recent() {
        // [7, 1, 2] matches at 0 (followed by 4); [1, 2] alone also at 5 (followed by 6)
        let t = [7, 1, 2, 4, 0, 1, 2, 6, 7, 1, 2];
        assert_eq!(propose(&t, 1, 3, 2), &[4, 0]);
        assert_eq!(propose(&t, 1, 2, 2), &[6, 7]);
    }

    #[test]
    fn no_match_or_too_short_gives_nothing() {
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose(&[5], 1, 3, 4).is_empty());
        assert!(propose(&[1, 2, 1, 2], 3, 3, 4).is_empty());
        assert!(propose(&[1, 1, 1], 1, 2, 0).is_empty());
    }

    #[test]
    fn proposal_is_cut_at_the_end_of_history() {
        assert_eq!(propose(&[4, 4, 4, 4], 1, 2, 5), &[4]);
    }
}
