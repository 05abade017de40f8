/* The math family's element-wise maps (rows of OPS_EW_MATH, ops_list_math.h), run by the EW and
 * FOREACH kernels. Each computes in double and is rounded once at the store (kern.h); where torch
 * picks between formulas (lerp's two branches, clamp's and maximum's NaN rules, sign), the map
 * follows the CPU kernels of aten/src/ATen/native (Lerp.h, cpu/UnaryOpsKernel.cpp,
 * cpu/BinaryOpsKernel.cpp, cpu/TensorCompareKernel.cpp) so that results agree with torch. */
#include "kern.h"

#define X0 x[0]
#define UNUSED_S (void)s

static double sigm(double v) { return 1.0 / (1.0 + exp(-v)); }

KHIDDEN double ew_neg(const double *x, const double *s) { UNUSED_S; return -X0; }
KHIDDEN double ew_abs(const double *x, const double *s) { UNUSED_S; return fabs(X0); }
KHIDDEN double ew_exp(const double *x, const double *s) { UNUSED_S; return exp(X0); }
KHIDDEN double ew_log(const double *x, const double *s) { UNUSED_S; return log(X0); }
KHIDDEN double ew_sqrt(const double *x, const double *s) { UNUSED_S; return sqrt(X0); }
KHIDDEN double ew_rsqrt(const double *x, const double *s) { UNUSED_S; return 1.0 / sqrt(X0); }
KHIDDEN double ew_reciprocal(const double *x, const double *s) { UNUSED_S; return 1.0 / X0; }
KHIDDEN double ew_tanh(const double *x, const double *s) { UNUSED_S; return tanh(X0); }
KHIDDEN double ew_sigmoid(const double *x, const double *s) { UNUSED_S; return sigm(X0); }
KHIDDEN double ew_silu(const double *x, const double *s) { UNUSED_S; return X0 / (1.0 + exp(-X0)); }
KHIDDEN double ew_erf(const double *x, const double *s) { UNUSED_S; return erf(X0); }
/* torch.sign: (0 < x) - (x < 0), so NaN gives 0 */
KHIDDEN double ew_sign(const double *x, const double *s) { UNUSED_S; return (double)((0.0 < X0) - (X0 < 0.0)); }
KHIDDEN double ew_floor(const double *x, const double *s) { UNUSED_S; return floor(X0); }
KHIDDEN double ew_ceil(const double *x, const double *s) { UNUSED_S; return ceil(X0); }
/* torch.round: half to even (std::nearbyint in the default rounding mode) */
KHIDDEN double ew_round(const double *x, const double *s) { UNUSED_S; return nearbyint(X0); }
KHIDDEN double ew_trunc(const double *x, const double *s) { UNUSED_S; return trunc(X0); }

KHIDDEN double ew_silu_bwd(const double *x, const double *s) {
    UNUSED_S;
    double sg = sigm(x[1]);
    return x[0] * sg * (1.0 + x[1] * (1.0 - sg));
}
KHIDDEN double ew_sigmoid_bwd(const double *x, const double *s) { UNUSED_S; return x[0] * (1.0 - x[1]) * x[1]; }
KHIDDEN double ew_tanh_bwd(const double *x, const double *s) { UNUSED_S; return x[0] * (1.0 - x[1] * x[1]); }

KHIDDEN double ew_bnot(const double *x, const double *s) { UNUSED_S; return (double)~(int64_t)X0; }
KHIDDEN double ew_lnot(const double *x, const double *s) { UNUSED_S; return X0 == 0.0; }
KHIDDEN double ew_land(const double *x, const double *s) { UNUSED_S; return x[0] != 0.0 && x[1] != 0.0; }
KHIDDEN double ew_lor(const double *x, const double *s) { UNUSED_S; return x[0] != 0.0 || x[1] != 0.0; }

KHIDDEN double ew_pow_ts(const double *x, const double *s) { return pow(X0, s[0]); }
KHIDDEN double ew_pow_st(const double *x, const double *s) { return pow(s[0], X0); }
KHIDDEN double ew_pow_tt(const double *x, const double *s) { UNUSED_S; return pow(x[0], x[1]); }

/* clamp: NaN stays NaN; min(max(x, lo), hi), so hi wins when lo > hi */
static double clamp3(double v, double lo, double hi) {
    if (v != v) return v;
    if (lo != lo) return lo;
    if (hi != hi) return hi;
    v = v < lo ? lo : v;
    return v > hi ? hi : v;
}
KHIDDEN double ew_clamp(const double *x, const double *s) { return clamp3(X0, s[0], s[1]); }
KHIDDEN double ew_clamp_t(const double *x, const double *s) { UNUSED_S; return clamp3(x[0], x[1], x[2]); }

static double maxn(double a, double b) { return a != a ? a : b != b ? b : a > b ? a : b; }
static double minn(double a, double b) { return a != a ? a : b != b ? b : a < b ? a : b; }
KHIDDEN double ew_maximum(const double *x, const double *s) { UNUSED_S; return maxn(x[0], x[1]); }
KHIDDEN double ew_minimum(const double *x, const double *s) { UNUSED_S; return minn(x[0], x[1]); }
KHIDDEN double ew_maxs(const double *x, const double *s) { return maxn(X0, s[0]); }
KHIDDEN double ew_mins(const double *x, const double *s) { return minn(X0, s[0]); }

KHIDDEN double ew_gt(const double *x, const double *s) { UNUSED_S; return x[0] > x[1]; }
KHIDDEN double ew_ge(const double *x, const double *s) { UNUSED_S; return x[0] >= x[1]; }
KHIDDEN double ew_lt(const double *x, const double *s) { UNUSED_S; return x[0] < x[1]; }
KHIDDEN double ew_le(const double *x, const double *s) { UNUSED_S; return x[0] <= x[1]; }
KHIDDEN double ew_eq(const double *x, const double *s) { UNUSED_S; return x[0] == x[1]; }
KHIDDEN double ew_ne(const double *x, const double *s) { UNUSED_S; return x[0] != x[1]; }
KHIDDEN double ew_gts(const double *x, const double *s) { return X0 > s[0]; }
KHIDDEN double ew_ges(const double *x, const double *s) { return X0 >= s[0]; }
KHIDDEN double ew_lts(const double *x, const double *s) { return X0 < s[0]; }
KHIDDEN double ew_les(const double *x, const double *s) { return X0 <= s[0]; }
KHIDDEN double ew_eqs(const double *x, const double *s) { return X0 == s[0]; }
KHIDDEN double ew_nes(const double *x, const double *s) { return X0 != s[0]; }

KHIDDEN double ew_masked_fill(const double *x, const double *s) { return x[1] != 0.0 ? s[0] : x[0]; }
KHIDDEN double ew_where(const double *x, const double *s) { UNUSED_S; return x[0] != 0.0 ? x[1] : x[2]; }

/* torch's lerp (Lerp.h): self + w (end - self) when |w| < 0.5, else end - (end - self)(1 - w) */
static double lerp(double a, double b, double w) { return fabs(w) < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w); }
KHIDDEN double ew_lerps(const double *x, const double *s) { return lerp(x[0], x[1], s[0]); }
KHIDDEN double ew_lerp(const double *x, const double *s) { UNUSED_S; return lerp(x[0], x[1], x[2]); }

KHIDDEN double ew_addcmul(const double *x, const double *s) { return x[0] + s[0] * x[1] * x[2]; }
/* the CPU's order: self + value * t1 / t2 (PointwiseOpsKernel.cpp) */
KHIDDEN double ew_addcdiv(const double *x, const double *s) { return x[0] + s[0] * x[1] / x[2]; }
KHIDDEN double ew_addcmul_t(const double *x, const double *s) { UNUSED_S; return x[0] + x[3] * x[1] * x[2]; }
KHIDDEN double ew_addcdiv_t(const double *x, const double *s) { UNUSED_S; return x[0] + x[3] * x[1] / x[2]; }
KHIDDEN double ew_rsubs(const double *x, const double *s) { return s[0] - s[1] * X0; }

KHIDDEN double ew_sin(const double *x, const double *s) { UNUSED_S; return sin(X0); }
KHIDDEN double ew_cos(const double *x, const double *s) { UNUSED_S; return cos(X0); }
KHIDDEN double ew_tan(const double *x, const double *s) { UNUSED_S; return tan(X0); }
KHIDDEN double ew_asin(const double *x, const double *s) { UNUSED_S; return asin(X0); }
KHIDDEN double ew_acos(const double *x, const double *s) { UNUSED_S; return acos(X0); }
KHIDDEN double ew_atan(const double *x, const double *s) { UNUSED_S; return atan(X0); }
KHIDDEN double ew_sinh(const double *x, const double *s) { UNUSED_S; return sinh(X0); }
KHIDDEN double ew_cosh(const double *x, const double *s) { UNUSED_S; return cosh(X0); }
KHIDDEN double ew_asinh(const double *x, const double *s) { UNUSED_S; return asinh(X0); }
KHIDDEN double ew_acosh(const double *x, const double *s) { UNUSED_S; return acosh(X0); }
KHIDDEN double ew_atanh(const double *x, const double *s) { UNUSED_S; return atanh(X0); }
KHIDDEN double ew_expm1(const double *x, const double *s) { UNUSED_S; return expm1(X0); }
KHIDDEN double ew_log1p(const double *x, const double *s) { UNUSED_S; return log1p(X0); }
KHIDDEN double ew_log2(const double *x, const double *s) { UNUSED_S; return log2(X0); }
KHIDDEN double ew_log10(const double *x, const double *s) { UNUSED_S; return log10(X0); }
KHIDDEN double ew_exp2(const double *x, const double *s) { UNUSED_S; return exp2(X0); }
KHIDDEN double ew_erfc(const double *x, const double *s) { UNUSED_S; return erfc(X0); }
KHIDDEN double ew_frac(const double *x, const double *s) { UNUSED_S; return X0 - trunc(X0); }
KHIDDEN double ew_isfinite(const double *x, const double *s) { UNUSED_S; return isfinite(X0) ? 1.0 : 0.0; }
KHIDDEN double ew_atan2(const double *x, const double *s) { UNUSED_S; return atan2(x[0], x[1]); }

/* torch.remainder (BinaryOpsKernel.cpp): fmod, moved to the divisor's sign */
static double py_mod(double a, double b) {
    double m = fmod(a, b);
    if (m != 0.0 && ((b < 0.0) != (m < 0.0))) m += b;
    return m;
}
KHIDDEN double ew_remainder(const double *x, const double *s) { UNUSED_S; return py_mod(x[0], x[1]); }
KHIDDEN double ew_remainder_ts(const double *x, const double *s) { return py_mod(X0, s[0]); }
KHIDDEN double ew_remainder_st(const double *x, const double *s) { return py_mod(s[0], X0); }
KHIDDEN double ew_fmod(const double *x, const double *s) { UNUSED_S; return fmod(x[0], x[1]); }
KHIDDEN double ew_fmod_ts(const double *x, const double *s) { return fmod(X0, s[0]); }

/* torch's div_floor_floating (aten/src/ATen/native/BinaryOps.h): exact for integers too */
static double floor_div(double a, double b) {
    if (b == 0.0) return a / b;
    double mod = fmod(a, b), div = (a - mod) / b;
    if (mod != 0.0 && ((b < 0.0) != (mod < 0.0))) div -= 1.0;
    double fd;
    if (div != 0.0) {
        fd = floor(div);
        if (div - fd > 0.5) fd += 1.0;
    } else {
        fd = copysign(0.0, a / b);
    }
    return fd;
}
KHIDDEN double ew_floor_div(const double *x, const double *s) { UNUSED_S; return floor_div(x[0], x[1]); }
KHIDDEN double ew_floor_divs(const double *x, const double *s) { return floor_div(X0, s[0]); }

KHIDDEN double ew_nan_to_num(const double *x, const double *s) {
    if (X0 != X0) return s[0];
    if (X0 == INFINITY) return s[1];
    if (X0 == -INFINITY) return s[2];
    return X0;
}

/* torch.isclose (TensorCompare.cpp): equal, or both NaN with equal_nan, or a finite
 * |a - b| <= atol + |rtol * b| */
KHIDDEN double ew_isclose(const double *x, const double *s) {
    double a = x[0], b = x[1];
    if (a == b) return 1.0;
    if (s[2] != 0.0 && a != a && b != b) return 1.0;
    double err = fabs(a - b);
    return isfinite(err) && err <= s[1] + fabs(s[0] * b);
}

/* torch.round(x, decimals) (cpu/UnaryOpsKernel.cpp): x * 10^d rounded to dtype s1 (the CPU's
 * compute type), then to even, then divided (or, for d < 0, divided by 10^-d then multiplied) */
KHIDDEN double ew_round_dec(const double *x, const double *s) {
    int64_t d = (int64_t)s[0];
    int dt = (int)s[1];
    if (d >= 0) {
        double p = kround(dt, pow(10.0, (double)d));
        return nearbyint(kround(dt, X0 * p)) / p;
    }
    double p = kround(dt, pow(10.0, (double)-d));
    return nearbyint(kround(dt, X0 / p)) * p;
}

static double round_mode(double v, int mode) {
    switch (mode) {
    case 1: return nearbyint(v);
    case 2: return floor(v);
    case 3: return ceil(v);
    case 4: return round(v);
    case 5: return trunc(v);
    case 7: return v - trunc(v);
    default: return NAN;
    }
}
KHIDDEN double ew_round_mode(const double *x, const double *s) { return round_mode(X0, (int)s[0]); }
KHIDDEN double ew_round_mode_t(const double *x, const double *s) { UNUSED_S; return round_mode(x[0], (int)x[1]); }

/* inverse erf: Giles' single-precision approximation ("Approximating the erfinv function", GPU
 * Computing Gems, 2011) refined by two Newton steps on erf in double */
KHIDDEN double ew_erfinv(const double *x, const double *s) {
    UNUSED_S;
    double y = X0;
    if (y != y || y < -1.0 || y > 1.0) return NAN;
    if (y == 1.0) return INFINITY;
    if (y == -1.0) return -INFINITY;
    double w = -log((1.0 - y) * (1.0 + y)), p;
    if (w < 5.0) {
        w -= 2.5;
        p = 2.81022636e-08;
        p = 3.43273939e-07 + p * w;
        p = -3.5233877e-06 + p * w;
        p = -4.39150654e-06 + p * w;
        p = 0.00021858087 + p * w;
        p = -0.00125372503 + p * w;
        p = -0.00417768164 + p * w;
        p = 0.246640727 + p * w;
        p = 1.50140941 + p * w;
    } else {
        w = sqrt(w) - 3.0;
        p = -0.000200214257;
        p = 0.000100950558 + p * w;
        p = 0.00134934322 + p * w;
        p = -0.00367342844 + p * w;
        p = 0.00573950773 + p * w;
        p = -0.0076224613 + p * w;
        p = 0.00943887047 + p * w;
        p = 1.00167406 + p * w;
        p = 2.83297682 + p * w;
    }
    double r = p * y;
    for (int i = 0; i < 2; i++) r -= (erf(r) - y) / (1.1283791670955126 * exp(-r * r));
    return r;
}

/* torch.logit: log(z / (1 - z)), z clamped to [eps, 1 - eps] when eps >= 0 */
KHIDDEN double ew_logit(const double *x, const double *s) {
    double z = X0, eps = s[0];
    if (eps >= 0.0 && z == z) z = z < eps ? eps : z > 1.0 - eps ? 1.0 - eps : z;
    return log(z / (1.0 - z));
}

/* torch.xlogy: NaN if y is NaN, 0 if x is 0, else x log y */
static double xlogy(double a, double b) { return b != b ? NAN : a == 0.0 ? 0.0 : a * log(b); }
KHIDDEN double ew_xlogy(const double *x, const double *s) { UNUSED_S; return xlogy(x[0], x[1]); }
KHIDDEN double ew_xlogy_ts(const double *x, const double *s) { return xlogy(X0, s[0]); }
KHIDDEN double ew_xlogy_st(const double *x, const double *s) { return xlogy(s[0], X0); }

KHIDDEN double ew_isneginf(const double *x, const double *s) { UNUSED_S; return X0 == -INFINITY; }
KHIDDEN double ew_isposinf(const double *x, const double *s) { UNUSED_S; return X0 == INFINITY; }
KHIDDEN double ew_signbit(const double *x, const double *s) { UNUSED_S; return signbit(X0) ? 1.0 : 0.0; }
KHIDDEN double ew_lxor(const double *x, const double *s) { UNUSED_S; return (x[0] != 0.0) != (x[1] != 0.0); }
KHIDDEN double ew_band(const double *x, const double *s) { UNUSED_S; return (double)((int64_t)x[0] & (int64_t)x[1]); }
KHIDDEN double ew_bor(const double *x, const double *s) { UNUSED_S; return (double)((int64_t)x[0] | (int64_t)x[1]); }
KHIDDEN double ew_bxor(const double *x, const double *s) { UNUSED_S; return (double)((int64_t)x[0] ^ (int64_t)x[1]); }
KHIDDEN double ew_bands(const double *x, const double *s) { return (double)((int64_t)X0 & (int64_t)s[0]); }
KHIDDEN double ew_bors(const double *x, const double *s) { return (double)((int64_t)X0 | (int64_t)s[0]); }
KHIDDEN double ew_bxors(const double *x, const double *s) { return (double)((int64_t)X0 ^ (int64_t)s[0]); }
