//! Token trees (docs/trees.md): a proposal of N nodes under the request's last
//! confirmed token (the **root**), each with a parent index (-1 = child of the root).
//! Parents come before children, so the first m nodes of a proposal are a tree.
//!
//! Indices: proposal node k is tree node `k + 1` (root = tree node 0). Tree node i of a
//! run whose root is at position c sits at KV slot position `c + i` and RoPE position
//! `c + depth(i)`; its `tree_mask` has bit j set for every tree node j it may see
//! (itself, its ancestors, the root).

use crate::error::{CoreError, Result};

/// Nodes of one tree proposal at most: root + nodes fit the 64-bit `tree_mask`.
pub const MAX_TREE_NODES: usize = 63;

/// Whether `parents` is the chain `[-1, 0, 1, ...]` (the degenerate tree).
pub fn is_chain(parents: &[i32]) -> bool {
    parents.iter().enumerate().all(|(k, &p)| p == k as i32 - 1)
}

/// Checks the `draft_parents` of every proposal (segments given by `cu_num_draft`,
/// already validated against `num_drafts`): one parent per draft, each
/// `-1 <= parent < own index` within its proposal, and at most `MAX_TREE_NODES`
/// nodes in a proposal that is not a chain.
pub fn validate_draft_parents(
    parents: &[i32],
    cu_num_draft: &[i32],
    num_drafts: usize,
) -> Result<()> {
    if parents.len() != num_drafts {
        return Err(CoreError::invalid(
            "draft_parents",
            format!(
                "has {} entries but {num_drafts} draft tokens were given",
                parents.len()
            ),
        ));
    }
    for (r, w) in cu_num_draft.windows(2).enumerate() {
        let seg = &parents[w[0] as usize..w[1] as usize];
        for (k, &p) in seg.iter().enumerate() {
            if p < -1 || p >= k as i32 {
                return Err(CoreError::invalid(
                    "draft_parents",
                    format!(
                        "proposal {r}: node {k} has parent {p}; a parent must be -1 (the root) \
                         or the index of an earlier node"
                    ),
                ));
            }
        }
        if seg.len() > MAX_TREE_NODES && !is_chain(seg) {
            return Err(CoreError::invalid(
                "draft_parents",
                format!(
                    "proposal {r}: a tree of {} nodes exceeds MAX_TREE_NODES = {MAX_TREE_NODES}",
                    seg.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Depths and masks of the root and the first `parents.len()` nodes of a tree
/// (tree node indices: root = 0). `parents.len() <= MAX_TREE_NODES`.
#[derive(Debug)]
pub struct TreeLayout {
    pub depth: [u8; MAX_TREE_NODES + 1],
    pub mask: [u64; MAX_TREE_NODES + 1],
}

impl TreeLayout {
    pub fn new(parents: &[i32]) -> Self {
        debug_assert!(parents.len() <= MAX_TREE_NODES);
        let mut t = TreeLayout {
            depth: [0; MAX_TREE_NODES + 1],
            mask: [0; MAX_TREE_NODES + 1],
        };
        t.mask[0] = 1;
        for (k, &p) in parents.iter().enumerate() {
            let parent = (p + 1) as usize;
            t.depth[k + 1] = t.depth[parent] + 1;
            t.mask[k + 1] = t.mask[parent] | (1u64 << (k + 1));
        }
        t
    }
}

/// The accepted path of a verified tree: for each accepted token, the proposal
/// node (0-based) it was accepted at, descending from the root into the
/// **lowest-index** child (among the first `m = parents.len()` nodes) whose token
/// is the emitted one. Writes the nodes into `path` and returns how many, or None
/// when the tokens do not follow a path of the tree.
pub fn accepted_path(
    drafts: &[u32],
    parents: &[i32],
    accepted: &[u32],
    path: &mut [u8; MAX_TREE_NODES],
) -> Option<usize> {
    let m = parents.len();
    let mut u: i32 = -1; // current node (proposal index; -1 = root)
    let mut start = 0; // children of u come after u
    for (j, &tok) in accepted.iter().enumerate() {
        let child = (start..m).find(|&k| parents[k] == u && drafts[k] == tok)?;
        path[j] = child as u8;
        u = child as i32;
        start = child + 1;
    }
    Some(accepted.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_recognised() {
        assert!(is_chain(&[]));
        assert!(is_chain(&[-1, 0, 1]));
        assert!(!is_chain(&[-1, -1]));
        assert!(!is_chain(&[-1, 0, 0]));
    }

    #[test]
    fn parents_are_validated_per_proposal_and_name_the_field() {
        let cu = [0, 2, 5];
        assert!(validate_draft_parents(&[-1, 0, -1, -1, 1], &cu, 5).is_ok());
        for bad in [
            vec![-1, 0, 0, -1, 1],  // second proposal's node 0 has parent 0 (itself)
            vec![-1, 1, -1, -1, 1], // parent == own index
            vec![-2, 0, -1, -1, 1], // below -1
            vec![-1, 0, -1, -1, 3], // a later node
        ] {
            let err = validate_draft_parents(&bad, &cu, 5)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("draft_parents:"), "{err}");
        }
        let err = validate_draft_parents(&[-1, 0], &cu, 5)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("draft_parents:"), "{err}");
        // 64 nodes: refused as a tree, accepted as a chain
        let chain: Vec<i32> = (-1..63).collect();
        assert!(validate_draft_parents(&chain, &[0, 64], 64).is_ok());
        let mut tree = chain.clone();
        tree[5] = -1;
        let err = validate_draft_parents(&tree, &[0, 64], 64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MAX_TREE_NODES"), "{err}");
        tree.pop();
        assert!(validate_draft_parents(&tree, &[0, 63], 63).is_ok());
    }

    #[test]
    fn layout_gives_depths_and_ancestor_masks() {
        // root -> {0, 1}; 0 -> {2}; 2 -> {3}; 1 -> {4}
        let t = TreeLayout::new(&[-1, -1, 0, 2, 1]);
        assert_eq!(&t.depth[..6], &[0, 1, 1, 2, 3, 2]);
        assert_eq!(&t.mask[..6], &[0b1, 0b11, 0b101, 0b1011, 0b11011, 0b100101]);
        // 63 nodes in a chain: the last mask is all 64 bits
        let chain: Vec<i32> = (-1..62).collect();
        assert_eq!(TreeLayout::new(&chain).mask[63], u64::MAX);
    }

    #[test]
    fn accepted_path_descends_into_the_lowest_index_matching_child() {
        // root -> {0:a, 1:b, 2:a}; 0 -> {3:c}; 2 -> {4:d}
        let (a, b, c, d) = (10, 11, 12, 13);
        let drafts = [a, b, a, c, d];
        let parents = [-1, -1, -1, 0, 2];
        let mut path = [0u8; MAX_TREE_NODES];
        assert_eq!(
            accepted_path(&drafts, &parents, &[a, c], &mut path),
            Some(2)
        );
        assert_eq!(&path[..2], &[0, 3]);
        assert_eq!(accepted_path(&drafts, &parents, &[b], &mut path), Some(1));
        assert_eq!(path[0], 1);
        // "a" then "d": the lowest-index "a" (node 0) has no child "d"
        assert_eq!(accepted_path(&drafts, &parents, &[a, d], &mut path), None);
        assert_eq!(accepted_path(&drafts, &parents, &[c], &mut path), None);
        assert_eq!(accepted_path(&drafts, &parents, &[], &mut path), Some(0));
        // only the first m nodes count
        assert_eq!(
            accepted_path(&drafts[..3], &parents[..3], &[a, c], &mut path),
            None
        );
    }
}
