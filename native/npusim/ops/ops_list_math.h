/* The math family's rows of ops_list.h (which says what a row is). */
#ifndef NPUSIM_OPS_LIST_MATH_H
#define NPUSIM_OPS_LIST_MATH_H

/* FOREACH: one EW map over G groups of tensors (k_math_foreach.c says the layout);
 * FOREACH_NORM: out_g = ||in_g||_p for each pair (in_g, out_g), s[0] = p;
 * ARGRED: the max or min along one dimension with its index (MaxDim, MinDim);
 * RAND: a fill from a counter-based generator (normal, uniform, bernoulli);
 * AMP: GradScaler's unscale-and-check of a gradient list, and its scale update;
 * BOOLRED: any/all over a dim set, and torch.equal of two tensors;
 * STAT: logsumexp, var, std (with the mean), aminmax over a dim set;
 * SCAN: cumsum and cumprod along one dimension;
 * DOMASK: dropout's apply of a bit mask made by RAND (kind 4);
 * SAMPLE: multinomial sampling of rows, and a random permutation. */
#define OPS_KERNELS_MATH(X)                                                                       \
    X(FOREACH, k_foreach)                                                                         \
    X(FOREACH_NORM, k_foreach_norm)                                                               \
    X(ARGRED, k_argred)                                                                           \
    X(RAND, k_rand)                                                                               \
    X(AMP, k_amp)                                                                                 \
    X(BOOLRED, k_boolred)                                                                         \
    X(STAT, k_stat)                                                                               \
    X(SCAN, k_scan)                                                                               \
    X(DOMASK, k_domask)                                                                           \
    X(SAMPLE, k_sample)

/* x[] are the inputs in order, s[] the scalars (k_math_ew.c defines each function). */
#define OPS_EW_MATH(X)                                                                            \
    X(NEG, ew_neg)                                                                                \
    X(ABS, ew_abs)                                                                                \
    X(EXP, ew_exp)                                                                                \
    X(LOG, ew_log)                                                                                \
    X(SQRT, ew_sqrt)                                                                              \
    X(RSQRT, ew_rsqrt)                                                                            \
    X(RECIPROCAL, ew_reciprocal)                                                                  \
    X(TANH, ew_tanh)                                                                              \
    X(SIGMOID, ew_sigmoid)                                                                        \
    X(SILU, ew_silu)                                                                              \
    X(ERF, ew_erf)                                                                                \
    X(SIGN, ew_sign)                                                                              \
    X(FLOOR, ew_floor)                                                                            \
    X(CEIL, ew_ceil)                                                                              \
    X(ROUND, ew_round)                                                                            \
    X(TRUNC, ew_trunc)                                                                            \
    X(SILU_BWD, ew_silu_bwd)       /* x0 grad, x1 self */                                       \
    X(SIGMOID_BWD, ew_sigmoid_bwd) /* x0 grad, x1 output */                                     \
    X(TANH_BWD, ew_tanh_bwd)       /* x0 grad, x1 output */                                     \
    X(BNOT, ew_bnot)               /* integers: ~x */                                            \
    X(LNOT, ew_lnot)               /* bool and logical_not: x == 0 */                            \
    X(LAND, ew_land)                                                                              \
    X(LOR, ew_lor)                                                                                \
    X(POW_TS, ew_pow_ts)           /* x0 ^ s0 */                                                 \
    X(POW_ST, ew_pow_st)           /* s0 ^ x0 */                                                 \
    X(POW_TT, ew_pow_tt)           /* x0 ^ x1 */                                                 \
    X(CLAMP, ew_clamp)             /* s0 min, s1 max (+-inf when absent) */                      \
    X(CLAMP_T, ew_clamp_t)         /* x1 min, x2 max */                                          \
    X(MAXIMUM, ew_maximum)                                                                        \
    X(MINIMUM, ew_minimum)                                                                        \
    X(MAXS, ew_maxs)               /* max(x0, s0), NaN propagating */                            \
    X(MINS, ew_mins)                                                                              \
    X(GT, ew_gt)                                                                                  \
    X(GE, ew_ge)                                                                                  \
    X(LT, ew_lt)                                                                                  \
    X(LE, ew_le)                                                                                  \
    X(EQ, ew_eq)                                                                                  \
    X(NE, ew_ne)                                                                                  \
    X(GTS, ew_gts)                                                                                \
    X(GES, ew_ges)                                                                                \
    X(LTS, ew_lts)                                                                                \
    X(LES, ew_les)                                                                                \
    X(EQS, ew_eqs)                                                                                \
    X(NES, ew_nes)                                                                                \
    X(MASKED_FILL, ew_masked_fill) /* x1 ? s0 : x0 */                                            \
    X(WHERE, ew_where)             /* x0 ? x1 : x2 (also masked fill with a tensor value) */     \
    X(LERPS, ew_lerps)             /* x0 + s0 (x1 - x0), as torch's lerp */                      \
    X(LERP, ew_lerp)               /* weight x2 */                                               \
    X(ADDCMUL, ew_addcmul)         /* x0 + s0 x1 x2 */                                           \
    X(ADDCDIV, ew_addcdiv)         /* x0 + s0 x1 / x2 */                                         \
    X(ADDCMUL_T, ew_addcmul_t)     /* x0 + x3 x1 x2 (a scalar held by a device tensor) */        \
    X(ADDCDIV_T, ew_addcdiv_t)                                                                    \
    X(RSUBS, ew_rsubs)             /* s0 - s1 x0 */                                              \
    X(SIN, ew_sin)                                                                                \
    X(COS, ew_cos)                                                                                \
    X(TAN, ew_tan)                                                                                \
    X(ASIN, ew_asin)                                                                              \
    X(ACOS, ew_acos)                                                                              \
    X(ATAN, ew_atan)                                                                              \
    X(SINH, ew_sinh)                                                                              \
    X(COSH, ew_cosh)                                                                              \
    X(ASINH, ew_asinh)                                                                            \
    X(ACOSH, ew_acosh)                                                                            \
    X(ATANH, ew_atanh)                                                                            \
    X(EXPM1, ew_expm1)                                                                            \
    X(LOG1P, ew_log1p)                                                                            \
    X(LOG2, ew_log2)                                                                              \
    X(LOG10, ew_log10)                                                                            \
    X(EXP2, ew_exp2)                                                                              \
    X(ERFC, ew_erfc)                                                                              \
    X(FRAC, ew_frac)                                                                              \
    X(ISFINITE, ew_isfinite)                                                                      \
    X(ATAN2, ew_atan2)             /* atan2(x0, x1) */                                           \
    X(REMAINDER, ew_remainder)     /* x0 mod x1, the sign of x1 (Python's %) */                  \
    X(REMAINDER_TS, ew_remainder_ts) /* x0 mod s0 */                                             \
    X(REMAINDER_ST, ew_remainder_st) /* s0 mod x0 */                                             \
    X(FMOD, ew_fmod)               /* C fmod(x0, x1) */                                          \
    X(FMOD_TS, ew_fmod_ts)                                                                        \
    X(FLOOR_DIV, ew_floor_div)     /* floor(x0 / x1) as torch's div_floor */                     \
    X(FLOOR_DIVS, ew_floor_divs)                                                                  \
    X(NAN_TO_NUM, ew_nan_to_num)   /* s0 for NaN, s1 for +inf, s2 for -inf */                    \
    X(ISCLOSE, ew_isclose)         /* s0 rtol, s1 atol, s2 equal_nan */                          \
    X(ROUND_DEC, ew_round_dec)     /* s0 decimals, s1 the dtype x*10^d is rounded to */          \
    X(ROUND_MODE, ew_round_mode)   /* CANN RoundMode s0: 1 rint, 2 floor, 3 ceil, 4 round, 5 trunc, 7 frac */ \
    X(ROUND_MODE_T, ew_round_mode_t) /* the mode in x1 */                                        \
    X(ERFINV, ew_erfinv)                                                                          \
    X(LOGIT, ew_logit)             /* s0 eps (< 0: none) */                                      \
    X(XLOGY, ew_xlogy)             /* x0 log x1 */                                               \
    X(XLOGY_TS, ew_xlogy_ts)       /* x0 log s0 */                                               \
    X(XLOGY_ST, ew_xlogy_st)       /* s0 log x0 */                                               \
    X(ISNEGINF, ew_isneginf)                                                                      \
    X(ISPOSINF, ew_isposinf)                                                                      \
    X(SIGNBIT, ew_signbit)                                                                        \
    X(LXOR, ew_lxor)                                                                              \
    X(BAND, ew_band)               /* integers: x0 & x1 */                                       \
    X(BOR, ew_bor)                                                                                \
    X(BXOR, ew_bxor)                                                                              \
    X(BANDS, ew_bands)             /* x0 & s0 */                                                 \
    X(BORS, ew_bors)                                                                              \
    X(BXORS, ew_bxors)

#define OPS_EW_MATH_DECL(id, fn) __attribute__((visibility("hidden"))) double fn(const double *x, const double *s);
OPS_EW_MATH(OPS_EW_MATH_DECL)
#undef OPS_EW_MATH_DECL

#endif
