/* The math family's rows of ops_list.h (which says what a row is). */
#ifndef NPUSIM_OPS_LIST_MATH_H
#define NPUSIM_OPS_LIST_MATH_H

#define OPS_KERNELS_MATH(X)

#define OPS_EW_MATH(X)

#endif
