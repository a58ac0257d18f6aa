//! The encoder: token embedding plus position embedding, `out[b,t] = wte[tok[b,t]] + wpe[t]`.
//!
//! Invariants: token ids are checked against V (a bad id panics rather than reading another row).

/// out: (B, T, C), tokens: (B, T), wte: (V, C), wpe: (maxT, C).
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    b: usize,
    t: usize,
    c: usize,
    v: usize,
) {
    for bt in 0..b * t {
        let tok = tokens[bt] as usize;
        assert!(tok < v, "encoder_forward: token {tok} out of vocabulary {v}");
        let pos = bt % t;
        let o = &mut out[bt * c..(bt + 1) * c];
        let (e, p) = (&wte[tok * c..(tok + 1) * c], &wpe[pos * c..(pos + 1) * c]);
        for i in 0..c {
            o[i] = e[i] + p[i];
        }
    }
}

/// dwte: (V, C) +=, dwpe: (maxT, C) +=, dout: (B, T, C), tokens: (B, T).
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    for bt in 0..b * t {
        let tok = tokens[bt] as usize;
        let pos = bt % t;
        let d = &dout[bt * c..(bt + 1) * c];
        for i in 0..c {
            dwte[tok * c + i] += d[i];
            dwpe[pos * c + i] += d[i];
        }
    }
}
