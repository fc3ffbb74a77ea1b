//! What an assignment needs of a model: [`Need`], a whole tensor or a byte range of one, and
//! [`expert_needs`], which turns a part of an expert split into the byte ranges of the experts
//! it holds in each packed expert tensor.

use std::ops::Range;

use tessera_model::GgufFile;

use super::StoreError;

/// Bytes of one tensor that an assignment needs: all of it, or one range of it.
///
/// Transfer and verification stay per chunk: a range is widened to the chunks that overlap it.
/// A chunk straddling the boundary of a needed range is fetched (and verified) whole, so a range
/// costs at most one partly needed chunk at each end, and a chunk shared by two needed ranges
/// (two adjacent experts, say) is fetched once. The bytes of such a boundary chunk outside the
/// range are real model bytes, not holes; the engine simply does not use them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Need {
    pub tensor: String,
    /// Bytes relative to the tensor's first byte; `None`: the whole tensor.
    pub range: Option<Range<u64>>,
}

impl Need {
    /// The whole tensor `tensor`.
    pub fn whole(tensor: impl Into<String>) -> Self {
        Self {
            tensor: tensor.into(),
            range: None,
        }
    }

    /// Bytes `range` of tensor `tensor` (relative to its first byte).
    pub fn bytes(tensor: impl Into<String>, range: Range<u64>) -> Self {
        Self {
            tensor: tensor.into(),
            range: Some(range),
        }
    }

    /// Each name as a whole tensor.
    pub fn whole_tensors<S: AsRef<str>>(names: &[S]) -> Vec<Self> {
        names.iter().map(|n| Self::whole(n.as_ref())).collect()
    }
}

/// Layer of a packed expert tensor name, `blk.<N>.ffn_<gate|up|down>_exps.weight`.
fn packed_expert_layer(name: &str) -> Option<usize> {
    let (n, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let part = rest.strip_prefix("ffn_")?.strip_suffix("_exps.weight")?;
    if !matches!(part, "gate" | "up" | "down") {
        return None;
    }
    n.parse().ok()
}

/// What a part of an expert split needs of the tensors `names`: each whole, except the packed
/// expert tensors `blk.<N>.ffn_{gate,up,down}_exps.weight`, of which only the byte ranges of
/// the experts `held[N]` are needed (none when `held` names no expert of layer `N`).
///
/// A packed tensor's outermost dimension is the expert, so expert `e` of `n` is the contiguous
/// bytes `e * len / n .. (e + 1) * len / n` — what the engine's loader reads for it. Adjacent
/// held experts make one range. `g` is the model's GGUF header (only the tensor index is read,
/// so a sparse file holding just the header will do).
pub fn expert_needs<S: AsRef<str>>(
    g: &GgufFile,
    names: &[S],
    held: &[Vec<usize>],
) -> Result<Vec<Need>, StoreError> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let name = name.as_ref();
        let Some(layer) = packed_expert_layer(name) else {
            out.push(Need::whole(name));
            continue;
        };
        let bad = |what: String| StoreError::Experts {
            tensor: name.to_string(),
            what,
        };
        let t = g.require_tensor(name)?;
        let n = match t.shape[..] {
            [_, _, n] if n > 0 && t.n_bytes % n == 0 => n,
            _ => {
                return Err(bad(format!(
                    "shape {:?} ({} bytes) is not a stack of equal expert matrices",
                    t.shape, t.n_bytes
                )))
            }
        };
        let per = t.n_bytes / n;
        let mut ids: Vec<u64> = held
            .get(layer)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|&e| e as u64)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if let Some(&e) = ids.iter().find(|&&e| e >= n) {
            return Err(bad(format!(
                "has {n} experts; expert {e} is not one of them"
            )));
        }
        let mut i = 0;
        while i < ids.len() {
            let mut j = i + 1;
            while j < ids.len() && ids[j] == ids[j - 1] + 1 {
                j += 1;
            }
            out.push(Need::bytes(name, ids[i] * per..ids[j - 1] * per + per));
            i = j;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_model;

    #[test]
    fn expert_needs_are_the_held_experts_slices() {
        let g = GgufFile::open(test_model("small-qwen3moe-Q8_0.gguf")).unwrap();
        let names = vec![
            "blk.0.ffn_gate_exps.weight",
            "blk.0.attn_q.weight",
            "blk.1.ffn_down_exps.weight",
            "blk.2.ffn_up_exps.weight",
            "blk.0.ffn_gate_inp.weight",
        ];
        let len = |n: &str| g.tensor(n).unwrap().n_bytes;
        let per = len("blk.0.ffn_gate_exps.weight") / 8;
        let held = vec![vec![5, 0, 3], vec![1, 2, 3], vec![]];
        let needs = expert_needs(&g, &names, &held).unwrap();
        let gate = "blk.0.ffn_gate_exps.weight";
        let down = "blk.1.ffn_down_exps.weight";
        assert_eq!(
            needs,
            vec![
                Need::bytes(gate, 0..per),
                Need::bytes(gate, 3 * per..4 * per),
                Need::bytes(gate, 5 * per..6 * per),
                Need::whole("blk.0.attn_q.weight"),
                // Adjacent experts: one range.
                Need::bytes(down, len(down) / 8..4 * (len(down) / 8)),
                // Layer 2 holds no expert: nothing of its packed tensors.
                Need::whole("blk.0.ffn_gate_inp.weight"),
            ]
        );
        // Layers past the end of `held` hold none either.
        assert_eq!(expert_needs(&g, &names[2..3], &[]).unwrap(), vec![]);
        let err = expert_needs(&g, &names[..1], &[vec![8]]).unwrap_err();
        assert!(matches!(err, StoreError::Experts { .. }), "{err}");
        assert_eq!(packed_expert_layer("blk.12.ffn_up_exps.weight"), Some(12));
        assert_eq!(packed_expert_layer("blk.1.ffn_up_shexp.weight"), None);
        assert_eq!(packed_expert_layer("blk.1.ffn_up.weight"), None);
    }
}
