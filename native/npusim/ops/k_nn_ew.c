/* The nn family's element-wise maps (rows of OPS_EW_NN, run by the EW kernel): activations, their
 * gradients and the squared difference of MseLoss. Each computes in double and the EW kernel
 * rounds once to the output's type. The formulas are torch's CPU kernels' (aten/src/ATen/native/
 * cpu/Activation.cpp: GeluKernelImpl, GeluBackwardKernelImpl; threshold_backward is
 * threshold(self, threshold, 0) applied to the gradient, so self <= threshold gives 0). */
#include "kern.h"

#define K_SQRT1_2 0.70710678118654752440
#define K_2_SQRTPI 1.12837916709551257390
#define K_SQRT2 1.41421356237309504880

KHIDDEN double ew_relu(const double *x, const double *s) {
    (void)s;
    return x[0] > 0.0 ? x[0] : (x[0] != x[0] ? x[0] : 0.0); /* NaN stays NaN, as clamp_min(0) */
}

KHIDDEN double ew_threshold_bwd(const double *x, const double *s) { return x[1] <= s[0] ? 0.0 : x[0]; }

KHIDDEN double ew_gelu(const double *x, const double *s) {
    (void)s;
    return x[0] * 0.5 * (1.0 + erf(x[0] * K_SQRT1_2));
}

static double gelu_inner(double v) { return K_SQRT2 * K_2_SQRTPI * 0.5 * (v + 0.044715 * v * v * v); }

KHIDDEN double ew_gelu_tanh(const double *x, const double *s) {
    (void)s;
    return 0.5 * x[0] * (1.0 + tanh(gelu_inner(x[0])));
}

KHIDDEN double ew_gelu_bwd(const double *x, const double *s) {
    (void)s;
    double v = x[1];
    double cdf = 0.5 * (1.0 + erf(v * K_SQRT1_2));
    double pdf = exp(-0.5 * v * v) * K_2_SQRTPI * K_SQRT1_2 * 0.5;
    return x[0] * (cdf + v * pdf);
}

KHIDDEN double ew_gelu_tanh_bwd(const double *x, const double *s) {
    (void)s;
    double v = x[1];
    double kbeta = K_SQRT2 * K_2_SQRTPI * 0.5;
    double t = tanh(gelu_inner(v));
    double left = 0.5 * v, right = 1.0 + t;
    double left_d = 0.5 * right;
    double right_d = left * (1.0 - t * t) * kbeta * (1.0 + 3.0 * 0.044715 * v * v);
    return x[0] * (left_d + right_d);
}

KHIDDEN double ew_sqdiff(const double *x, const double *s) {
    (void)s;
    double d = x[0] - x[1];
    return d * d;
}

KHIDDEN double ew_mse_bwd(const double *x, const double *s) { return s[0] * (x[0] - x[1]) * x[2]; }
