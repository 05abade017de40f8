/* The nn family's rows of ops_list.h (which says what a row is). */
#ifndef NPUSIM_OPS_LIST_NN_H
#define NPUSIM_OPS_LIST_NN_H

#define OPS_KERNELS_NN(X)

#define OPS_EW_NN(X)

#endif
