/* Prints, as JSON, what the C compiler makes of npusnap/contract.h: every struct's size and field
 * offsets, and every integer and string constant. tests/unit/test_contract.py compiles and runs it
 * and compares the output with npusnap_cli/contract.py (generated from the same spec), so that a
 * layout Python reads with struct/ctypes is the one C code writes.
 *
 *     cc -Inative/include native/contract/layout.c -o layout && ./layout
 */
#include <stdio.h>

#define NPUSNAP_CONTRACT_CANN_NAMES /* the ACL codes by CANN's names, as npusnap's C code uses them */
#include "npusnap/contract.h"

static void json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

int main(void) {
    const char *sep = "";
    printf("{\"structs\": {");
#define S(name) printf("%s\"%s\": {\"size\": %zu, \"offsets\": {", sep, #name, sizeof(struct name)), sep = "}}, ", first = 1;
#define F(name, field)                                                                          \
    printf("%s\"%s\": %zu", first ? "" : ", ", #field, offsetof(struct name, field)), first = 0;
    int first = 1;
    NPUSNAP_CONTRACT_STRUCTS(S, F)
#undef S
#undef F
    printf("}}}, \"ints\": {");
    sep = "";
#define X(name) printf("%s\"%s\": %lld", sep, #name, (long long)(name)), sep = ", ";
    NPUSNAP_CONTRACT_INTS(X)
#undef X
    printf("}, \"strings\": {");
    sep = "";
#define X(name) printf("%s\"%s\": ", sep, #name), json_string(name), sep = ", ";
    NPUSNAP_CONTRACT_STRINGS(X)
#undef X
    printf("}}\n");
    return 0;
}
