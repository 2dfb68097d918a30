//! The result of `Scheduler::update`, and validation of the ragged (`cu_*`)
//! arrays that cross the boundary.

use crate::error::{CoreError, Result};
use crate::request::{FinishReason, RequestId};

/// Tokens appended by one `update` (M = requests that got tokens, N = tokens,
/// F = finished requests).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UpdateOutput {
    pub req_ids: Vec<u64>,                 // [M]
    pub cu_num_new: Vec<i32>,              // [M + 1]
    pub new_token_ids: Vec<i64>,           // [N]
    pub finished_req_ids: Vec<u64>,        // [F]
    pub finish_reasons: Vec<FinishReason>, // [F]
    pub stop_token: Vec<i64>,              // [F] token that caused "stop", or -1
}

impl UpdateOutput {
    pub fn with_capacity(num_reqs: usize, num_tokens: usize) -> Self {
        let mut cu_num_new = Vec::with_capacity(num_reqs + 1);
        cu_num_new.push(0);
        UpdateOutput {
            req_ids: Vec::with_capacity(num_reqs),
            cu_num_new,
            new_token_ids: Vec::with_capacity(num_tokens),
            ..Default::default()
        }
    }

    pub(crate) fn push_tokens(&mut self, id: RequestId, tokens: &[u32]) {
        self.req_ids.push(id);
        self.new_token_ids.extend(tokens.iter().map(|&t| t as i64));
        self.cu_num_new.push(self.new_token_ids.len() as i32);
    }

    pub(crate) fn push_finished(&mut self, id: RequestId, reason: FinishReason, stop_token: i64) {
        self.finished_req_ids.push(id);
        self.finish_reasons.push(reason);
        self.stop_token.push(stop_token);
    }
}

/// Checks a cumulative-offsets array of `num_rows + 1` entries: starts at 0, never
/// decreases, ends at `num_items`.
pub fn validate_cu(
    field: &'static str,
    cu: &[i32],
    num_rows: usize,
    num_items: usize,
) -> Result<()> {
    if cu.len() != num_rows + 1 {
        return Err(CoreError::invalid(
            field,
            format!("has {} entries, expected {}", cu.len(), num_rows + 1),
        ));
    }
    if cu[0] != 0 {
        return Err(CoreError::invalid(
            field,
            format!("must start at 0, got {}", cu[0]),
        ));
    }
    if cu.windows(2).any(|w| w[1] < w[0]) {
        return Err(CoreError::invalid(field, "must be non-decreasing"));
    }
    if cu[num_rows] as usize != num_items {
        return Err(CoreError::invalid(
            field,
            format!("ends at {} but {num_items} tokens were given", cu[num_rows]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_arrays_are_checked_and_name_their_field() {
        assert!(validate_cu("cu", &[0, 1, 3], 2, 3).is_ok());
        let err = validate_cu("cu_num_sampled", &[0, 2, 1], 2, 1).unwrap_err();
        assert!(err.to_string().starts_with("cu_num_sampled:"));
        assert!(validate_cu("cu", &[1, 2], 1, 2).is_err());
        assert!(validate_cu("cu", &[0, 2], 1, 3).is_err());
        assert!(validate_cu("cu", &[0], 1, 0).is_err());
    }
}
