//! Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025): model-free speculation trees
//! from depth-limited suffix tries over token histories.
//!
//! A `SuffixTrie` of depth D holds every substring of length <= D of the sequences put in it,
//! each node counting its substring's occurrences (so a child's count over its parent's is how
//! often that continuation followed). Two kinds of trie:
//! - one per request, over its prompt and output, built on its first proposal and extended by
//!   every committed token (the trie keeps the nodes of the context's last D - 1 suffixes, so
//!   an append costs O(D) and the match needs no search);
//! - one global trie over the outputs of the most recently ended requests (at most
//!   `max_cached_requests`; the oldest is removed, its counts subtracted, when one more ends).
//!
//! A proposal: every suffix of the request's context (at most D - 1 tokens) that has a
//! continuation in a trie is a candidate match; from its node, a best-first expansion by
//! cumulative probability (product of child count / parent count along the path) picks up to
//! `min(budget, floor(max_spec_factor * match_len))` nodes whose probability is at least
//! `min_token_prob`. The tree whose expected accepted tokens (the sum of the nodes'
//! probabilities) is largest wins, over both tries and all match lengths (the longest match
//! alone leaves a depth-D trie one token to draft once the match reaches D - 1; arctic's
//! SuffixDecoding scores every length the same way). Nodes come parents first: a token tree in the
//! `draft_parents` format (a chain when it is a path).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use crate::hash::FxBuildHasher;
use crate::request::RequestId;

const ROOT: u32 = 0;

#[derive(Debug, Clone)]
struct Node {
    count: u32,
    token: u32,
    parent: u32,
    depth: u32,
    children: Vec<u32>,
}

/// A depth-limited suffix trie with occurrence counts.
#[derive(Debug)]
pub struct SuffixTrie {
    nodes: Vec<Node>,
    free: Vec<u32>,
    edges: HashMap<u64, u32, FxBuildHasher>,
    max_depth: usize,
}

fn key(node: u32, token: u32) -> u64 {
    (u64::from(node) << 32) | u64::from(token)
}

impl SuffixTrie {
    pub fn new(max_depth: usize) -> Self {
        SuffixTrie {
            nodes: vec![Node {
                count: 0,
                token: 0,
                parent: ROOT,
                depth: 0,
                children: Vec::new(),
            }],
            free: Vec::new(),
            edges: HashMap::default(),
            max_depth: max_depth.max(1),
        }
    }

    /// Live nodes, the root included.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Heap bytes held (nodes, child lists, the edge table).
    pub fn bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self
                .nodes
                .iter()
                .map(|n| n.children.capacity() * 4)
                .sum::<usize>()
            + self.edges.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.free.capacity() * 4
    }

    pub fn child(&self, node: u32, token: u32) -> Option<u32> {
        self.edges.get(&key(node, token)).copied()
    }

    /// The occurrences of `tokens` as a substring (0 when absent or longer than the depth).
    pub fn count_of(&self, tokens: &[u32]) -> u32 {
        let mut n = ROOT;
        for &t in tokens {
            match self.child(n, t) {
                Some(c) => n = c,
                None => return 0,
            }
        }
        self.nodes[n as usize].count
    }

    fn child_or_add(&mut self, node: u32, token: u32) -> u32 {
        if let Some(c) = self.child(node, token) {
            return c;
        }
        let n = Node {
            count: 0,
            token,
            parent: node,
            depth: self.nodes[node as usize].depth + 1,
            children: Vec::new(),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = n;
                id
            }
            None => {
                self.nodes.push(n);
                (self.nodes.len() - 1) as u32
            }
        };
        self.edges.insert(key(node, token), id);
        self.nodes[node as usize].children.push(id);
        id
    }

    /// Appends `token` to a sequence whose last suffixes (depth < D, longest first) are
    /// `active`: every suffix grows by the token, a new one starts at it; counts follow.
    pub fn extend(&mut self, active: &mut Vec<u32>, token: u32) {
        self.nodes[ROOT as usize].count += 1;
        active.push(ROOT);
        let mut kept = 0;
        for i in 0..active.len() {
            let c = self.child_or_add(active[i], token);
            self.nodes[c as usize].count += 1;
            if (self.nodes[c as usize].depth as usize) < self.max_depth {
                active[kept] = c;
                kept += 1;
            }
        }
        active.truncate(kept);
    }

    /// Puts every suffix of `tokens` in (as `extend` token by token from an empty sequence).
    pub fn insert(&mut self, tokens: &[u32]) {
        let mut active = Vec::with_capacity(self.max_depth);
        for &t in tokens {
            self.extend(&mut active, t);
        }
    }

    /// Takes out what `insert(tokens)` put in: counts subtracted, emptied nodes removed.
    pub fn remove(&mut self, tokens: &[u32]) {
        let d = self.max_depth;
        let mut path = Vec::with_capacity(d);
        for i in 0..tokens.len() {
            let mut n = ROOT;
            path.clear();
            for &t in &tokens[i..(i + d).min(tokens.len())] {
                n = self
                    .child(n, t)
                    .expect("removing a sequence that was inserted");
                path.push(n);
            }
            self.nodes[ROOT as usize].count -= 1;
            for &p in &path {
                self.nodes[p as usize].count -= 1;
            }
            // a node reaching 0 has no counted descendants: delete deepest first
            for &p in path.iter().rev() {
                if self.nodes[p as usize].count == 0 {
                    self.delete(p);
                }
            }
        }
    }

    fn delete(&mut self, node: u32) {
        let (parent, token) = {
            let n = &self.nodes[node as usize];
            debug_assert!(
                n.children.is_empty(),
                "a node with no occurrences has no children"
            );
            (n.parent, n.token)
        };
        self.edges.remove(&key(parent, token));
        let siblings = &mut self.nodes[parent as usize].children;
        if let Some(k) = siblings.iter().position(|&c| c == node) {
            siblings.swap_remove(k);
        }
        self.nodes[node as usize].children = Vec::new();
        self.free.push(node);
    }

    /// Every suffix of `context` (at most D - 1 tokens) present with a continuation: (node,
    /// match length), longest first. O(D^2) lookups at worst; a suffix absent from the trie
    /// stops its walk at the first missing token.
    pub fn matches<'a>(&'a self, context: &'a [u32]) -> impl Iterator<Item = (u32, usize)> + 'a {
        let longest = context.len().min(self.max_depth - 1);
        (1..=longest).rev().filter_map(move |m| {
            let mut n = ROOT;
            for &t in &context[context.len() - m..] {
                n = self.child(n, t)?;
            }
            (!self.nodes[n as usize].children.is_empty()).then_some((n, m))
        })
    }

    /// The deepest node matching a suffix of `context` (at most D - 1 tokens) that has a
    /// continuation: (node, match length). Longest suffix first.
    pub fn longest_match(&self, context: &[u32]) -> Option<(u32, usize)> {
        let longest = context.len().min(self.max_depth - 1);
        for m in (1..=longest).rev() {
            let mut n = ROOT;
            let mut ok = true;
            for &t in &context[context.len() - m..] {
                match self.child(n, t) {
                    Some(c) => n = c,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok && !self.nodes[n as usize].children.is_empty() {
                return Some((n, m));
            }
        }
        None
    }

    /// Best-first speculation tree below `node`: appends (token, parent) to `tokens` /
    /// `parents` (parents index the appended nodes, -1 = `node`), at most `max_nodes`, each
    /// of probability >= `min_prob`. Returns the sum of their probabilities.
    pub fn draft(
        &self,
        node: u32,
        max_nodes: usize,
        min_prob: f64,
        tokens: &mut Vec<u32>,
        parents: &mut Vec<i32>,
    ) -> f64 {
        let mut heap = BinaryHeap::new();
        let push_children = |heap: &mut BinaryHeap<Cand>, n: u32, prob: f64, at: i32| {
            let total = f64::from(self.nodes[n as usize].count.max(1));
            for &c in &self.nodes[n as usize].children {
                let p = prob * f64::from(self.nodes[c as usize].count) / total;
                if p >= min_prob {
                    heap.push(Cand {
                        prob: p,
                        depth: self.nodes[c as usize].depth,
                        node: c,
                        parent: at,
                    });
                }
            }
        };
        push_children(&mut heap, node, 1.0, -1);
        let mut score = 0.0;
        let start = tokens.len();
        while tokens.len() - start < max_nodes {
            let Some(c) = heap.pop() else { break };
            tokens.push(self.nodes[c.node as usize].token);
            parents.push(c.parent);
            score += c.prob;
            let at = (tokens.len() - start - 1) as i32;
            push_children(&mut heap, c.node, c.prob, at);
        }
        score
    }
}

#[derive(Debug, PartialEq)]
struct Cand {
    prob: f64,
    depth: u32,
    node: u32,
    parent: i32,
}
impl Eq for Cand {}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        // most probable first; ties: the shallower node (siblings before one branch's depths:
        // the same expected acceptance, a better chance that some first token is right), then
        // the newer node (the most recent continuation, as prompt lookup prefers)
        self.prob
            .total_cmp(&o.prob)
            .then_with(|| o.depth.cmp(&self.depth))
            .then_with(|| self.node.cmp(&o.node))
    }
}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// One request's trie over its prompt and output, with its context's active suffixes.
#[derive(Debug)]
struct Local {
    trie: SuffixTrie,
    active: Vec<u32>,
    len: usize,
}

/// The per-request tries and the global trie of ended requests' outputs.
#[derive(Debug)]
pub struct SuffixCache {
    max_depth: usize,
    max_cached: usize,
    global: SuffixTrie,
    cached: VecDeque<Vec<u32>>,
    local: HashMap<RequestId, Local, FxBuildHasher>,
}

/// What `SuffixCache::propose` found for one request.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SuffixProposal {
    pub tokens: Vec<u32>,
    pub parents: Vec<i32>,
    pub match_len: usize,
    pub score: f64,
    /// The proposal came from the global trie (else the request's own).
    pub global: bool,
}

impl SuffixCache {
    pub fn new(max_depth: usize, max_cached_requests: usize) -> Self {
        SuffixCache {
            max_depth: max_depth.max(2),
            max_cached: max_cached_requests,
            global: SuffixTrie::new(max_depth.max(2)),
            cached: VecDeque::new(),
            local: HashMap::default(),
        }
    }

    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Builds a request's trie from its tokens so far, unless it has one (the scheduler calls it
    /// when a request is added, so a proposal never pays for the prompt; `propose` calls it too).
    pub fn start(&mut self, id: RequestId, history: &[u32]) {
        let depth = self.max_depth;
        self.local.entry(id).or_insert_with(|| {
            let mut trie = SuffixTrie::new(depth);
            let mut active = Vec::with_capacity(depth);
            for &t in history {
                trie.extend(&mut active, t);
            }
            Local {
                trie,
                active,
                len: history.len(),
            }
        });
    }

    /// Follows a request's committed tokens (`history` = all of them, the new ones last);
    /// a no-op for requests without a trie yet (it is built from the history when first needed).
    pub fn extend(&mut self, id: RequestId, history: &[u32], num_new: usize) {
        if let Some(l) = self.local.get_mut(&id) {
            debug_assert_eq!(l.len + num_new, history.len());
            for &t in &history[history.len() - num_new..] {
                l.trie.extend(&mut l.active, t);
            }
            l.len = history.len();
        }
    }

    /// A request ended: its trie goes; its output joins the global trie (the oldest cached
    /// output leaves when `max_cached_requests` are held).
    pub fn finish(&mut self, id: RequestId, output: &[u32]) {
        self.local.remove(&id);
        if self.max_cached == 0 || output.is_empty() {
            return;
        }
        while self.cached.len() >= self.max_cached {
            let old = self.cached.pop_front().expect("non-empty");
            self.global.remove(&old);
        }
        self.global.insert(output);
        self.cached.push_back(output.to_vec());
    }

    /// The speculation tree for a request whose committed tokens are `history`.
    pub fn propose(
        &mut self,
        id: RequestId,
        history: &[u32],
        budget: usize,
        max_spec_factor: f64,
        min_prob: f64,
    ) -> SuffixProposal {
        self.start(id, history);
        let l = &self.local[&id];
        debug_assert_eq!(l.len, history.len());
        let mut best = SuffixProposal::default();
        if budget == 0 {
            return best;
        }
        let cap = |m: usize| budget.min((max_spec_factor * m as f64).floor() as usize);
        // every match length, in both tries, longest first (a long match leaves the depth little
        // room to draft, a short one is weak evidence: the best tree decides, as arctic's does);
        // a length whose cap cannot beat the best score so far is skipped (score <= nodes <= cap)
        let mut cands: Vec<(usize, bool, u32)> = l
            .active
            .iter()
            .copied()
            .filter(|&n| !l.trie.nodes[n as usize].children.is_empty())
            .map(|n| (l.trie.nodes[n as usize].depth as usize, false, n))
            .collect();
        cands.extend(self.global.matches(history).map(|(n, m)| (m, true, n)));
        cands.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut tokens = Vec::with_capacity(budget);
        let mut parents = Vec::with_capacity(budget);
        for (m, global, node) in cands {
            if cap(m) as f64 <= best.score {
                continue;
            }
            let trie = if global { &self.global } else { &l.trie };
            tokens.clear();
            parents.clear();
            let score = trie.draft(node, cap(m), min_prob, &mut tokens, &mut parents);
            if score > best.score {
                best = SuffixProposal {
                    tokens: tokens.clone(),
                    parents: parents.clone(),
                    match_len: m,
                    score,
                    global,
                };
            }
        }
        best
    }

    /// (request, tokens its trie holds) for every request with a trie.
    pub fn local_lengths(&self) -> impl Iterator<Item = (RequestId, usize)> + '_ {
        self.local.iter().map(|(&id, l)| (id, l.len))
    }

    pub fn num_cached_requests(&self) -> usize {
        self.cached.len()
    }
    pub fn num_nodes(&self) -> usize {
        self.global.num_nodes()
            + self
                .local
                .values()
                .map(|l| l.trie.num_nodes())
                .sum::<usize>()
    }
    pub fn bytes(&self) -> usize {
        self.global.bytes()
            + self.cached.iter().map(|c| c.capacity() * 4).sum::<usize>()
            + self.local.values().map(|l| l.trie.bytes()).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn brute_count(seqs: &[Vec<u32>], pat: &[u32], depth: usize) -> u32 {
        if pat.len() > depth || pat.is_empty() {
            return 0;
        }
        seqs.iter()
            .map(|s| s.windows(pat.len()).filter(|w| *w == pat).count() as u32)
            .sum()
    }

    #[test]
    fn counts_are_substring_occurrences() {
        let mut t = SuffixTrie::new(3);
        t.insert(&[1, 2, 1, 2, 3]);
        assert_eq!(t.count_of(&[1, 2]), 2);
        assert_eq!(t.count_of(&[2, 1, 2]), 1);
        assert_eq!(t.count_of(&[1, 2, 1, 2]), 0); // deeper than the trie
        assert_eq!(t.count_of(&[3]), 1);
    }

    #[test]
    fn draft_follows_the_most_frequent_continuation() {
        let mut t = SuffixTrie::new(8);
        t.insert(&[5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8]);
        let (node, m) = t.longest_match(&[1, 5, 6]).unwrap();
        assert_eq!(m, 2);
        let (mut tok, mut par) = (vec![], vec![]);
        let score = t.draft(node, 3, 0.1, &mut tok, &mut par);
        // 7 follows "5 6" always; then 8 (2 of 3); then 9 (1/3) or 5 after 8 (2/3 * 1/2)
        assert_eq!(tok[..2], [7, 8]);
        assert_eq!(par[..2], [-1, 0]);
        assert_eq!((tok[2], par[2]), (9, 0)); // the tie with "8 5" (2/3 * 1/2) goes to the shallower
        assert!((score - (1.0 + 2.0 / 3.0 + 1.0 / 3.0)).abs() < 1e-9);
        let (mut tok, mut par) = (vec![], vec![]);
        t.draft(node, 10, 0.5, &mut tok, &mut par); // min_prob drops the 1/3 branches
        assert_eq!(tok, vec![7, 8]);
    }

    #[test]
    fn the_global_trie_evicts_the_oldest_output() {
        let mut c = SuffixCache::new(4, 2);
        c.finish(1, &[1, 2, 3]);
        c.finish(2, &[4, 5, 6]);
        c.finish(3, &[7, 8, 9]);
        assert_eq!(c.num_cached_requests(), 2);
        assert_eq!(c.global.count_of(&[1, 2]), 0);
        assert_eq!(c.global.count_of(&[4, 5]), 1);
        let p = c.propose(9, &[0, 7, 8], 4, 1.0, 0.0);
        assert_eq!((p.tokens, p.global, p.match_len), (vec![9], true, 2));
        c.finish(9, &[]);
        assert_eq!(c.num_cached_requests(), 2);
        assert!(c.local.is_empty());
    }

    #[test]
    fn own_history_grows_with_its_tokens() {
        let mut c = SuffixCache::new(6, 0);
        let mut h = vec![1, 2, 3, 4, 1, 2];
        assert_eq!(c.propose(7, &h, 4, 2.0, 0.0).tokens, vec![3, 4, 1, 2]);
        h.extend([3, 9]);
        c.extend(7, &h, 2);
        h.extend([1, 2, 3]);
        c.extend(7, &h, 3);
        let p = c.propose(7, &h, 6, 2.0, 0.0);
        // "1 2 3" was followed by 4 once and by 9 once: both are children of the root
        assert_eq!(p.match_len, 3);
        let firsts: Vec<u32> = p
            .tokens
            .iter()
            .zip(&p.parents)
            .filter(|(_, &q)| q == -1)
            .map(|(&t, _)| t)
            .collect();
        assert_eq!(firsts, vec![9, 4]); // equal odds: the most recent continuation first
        assert_eq!(
            c.propose(8, &[5, 5], 0, 1.0, 0.0),
            SuffixProposal::default()
        );
    }

    #[test]
    fn a_shorter_match_wins_when_the_longest_leaves_no_depth() {
        // 1..=20 twice, the second copy half done: the longest match (depth - 1 = 7 tokens) has
        // room for one draft below it; a 4-token match drafts 4 tokens that are all certain
        let first: Vec<u32> = (1..=20).collect();
        let mut h = first.clone();
        h.extend(1..=10);
        let mut c = SuffixCache::new(8, 0);
        let p = c.propose(1, &h, 8, 1.0, 0.1);
        assert_eq!(p.tokens, vec![11, 12, 13, 14]);
        assert_eq!(p.match_len, 4);
        assert!((p.score - 2.0).abs() < 1e-9, "{p:?}"); // each seen once before, beside itself
    }

    proptest! {
        #[test]
        fn insert_then_remove_keeps_exact_counts(
            seqs in prop::collection::vec(prop::collection::vec(0u32..4, 0..30), 1..6),
            depth in 1usize..6,
            drop in 0usize..6,
            pat in prop::collection::vec(0u32..4, 1..7),
        ) {
            let mut t = SuffixTrie::new(depth);
            for s in &seqs { t.insert(s); }
            let drop = drop.min(seqs.len());
            for s in &seqs[..drop] { t.remove(s); }
            let kept = &seqs[drop..];
            prop_assert_eq!(t.count_of(&pat), brute_count(kept, &pat, depth));
            // nothing stays allocated for removed sequences
            let live: usize = {
                let mut subs = std::collections::HashSet::new();
                for s in kept { for i in 0..s.len() { for j in i + 1..=(i + depth).min(s.len()) {
                    subs.insert(s[i..j].to_vec());
                } } }
                subs.len() + 1
            };
            prop_assert_eq!(t.num_nodes(), live);
        }

        #[test]
        fn incremental_extension_equals_insertion(
            seq in prop::collection::vec(0u32..5, 1..40), depth in 2usize..8,
        ) {
            let mut a = SuffixTrie::new(depth);
            a.insert(&seq);
            let mut c = SuffixCache::new(depth, 0);
            c.propose(1, &seq[..1], 1, 1.0, 0.0);
            for i in 2..=seq.len() { c.extend(1, &seq[..i], 1); }
            let b = &c.local[&1].trie;
            for i in 0..seq.len() { for j in i + 1..=(i + depth).min(seq.len()) {
                prop_assert_eq!(a.count_of(&seq[i..j]), b.count_of(&seq[i..j]));
            } }
            prop_assert_eq!(a.num_nodes(), b.num_nodes());
        }

        #[test]
        fn drafts_are_trees_within_budget_and_probability(
            seq in prop::collection::vec(0u32..3, 2..60), budget in 0usize..20, min_prob in 0.0f64..0.5,
        ) {
            let mut c = SuffixCache::new(6, 0);
            let p = c.propose(1, &seq, budget, 4.0, min_prob);
            prop_assert!(p.tokens.len() <= budget);
            prop_assert_eq!(p.tokens.len(), p.parents.len());
            for (i, &par) in p.parents.iter().enumerate() { prop_assert!(par >= -1 && par < i as i32); }
            prop_assert!(p.score <= p.tokens.len() as f64 + 1e-9);
        }
    }
}
