//! GELU with GPT-2's tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, the same
//! formula as PyTorch's `gelu(approximate="tanh")`.

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_CUBE: f32 = 0.044_715;

/// out: (N), inp: (N).
pub fn gelu_forward(out: &mut [f32], inp: &[f32], n: usize) {
    for (o, &x) in out[..n].iter_mut().zip(&inp[..n]) {
        let cube = GELU_CUBE * x * x * x;
        *o = 0.5 * x * (1.0 + (GELU_SCALE * (x + cube)).tanh());
    }
}

/// dinp: (N) +=, inp: (N), dout: (N).
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
    for ((di, &x), &d) in dinp[..n].iter_mut().zip(&inp[..n]).zip(&dout[..n]) {
        let cube = GELU_CUBE * x * x * x;
        let tanh_arg = GELU_SCALE * (x + cube);
        let tanh_out = tanh_arg.tanh();
        let sech2 = 1.0 - tanh_out * tanh_out;
        let local = 0.5 * (1.0 + tanh_out) + x * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
        *di += local * d;
    }
}
