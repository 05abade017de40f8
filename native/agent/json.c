/* A small JSON reader and writer for the agent's line protocol.
 *
 * Why not a library: the agent is preloaded into arbitrary programs, so it links nothing but
 * libc. The reader accepts what Python's json.loads accepts for the protocol's purposes
 * (objects, arrays, strings with escapes and surrogate pairs, numbers, true/false/null), with a
 * nesting limit; input is checked to be UTF-8 first, as the Python codec does.
 */
#include "agent_int.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 32

typedef struct parser {
    const char *p, *end;
    char *err;
    size_t errlen;
    int depth;
} parser;

static int fail(parser *ps, const char *msg) {
    if (ps->err && ps->errlen && !ps->err[0]) {
        snprintf(ps->err, ps->errlen, "%s", msg);
    }
    return -1;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) {
        ps->p++;
    }
}

static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        unsigned cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            k = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            k = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        for (size_t j = 1; j <= k; j++) {
            if (i + j >= n || (s[i + j] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF)) {
            return 0;
        }
        i += k + 1;
    }
    return 1;
}

static int parse_value(parser *ps, jval *v);

static void put_utf8(sbuf *b, unsigned cp) {
    char t[4];
    if (cp < 0x80) {
        t[0] = (char)cp;
        sb_rawn(b, t, 1);
    } else if (cp < 0x800) {
        t[0] = (char)(0xC0 | (cp >> 6));
        t[1] = (char)(0x80 | (cp & 0x3F));
        sb_rawn(b, t, 2);
    } else if (cp < 0x10000) {
        t[0] = (char)(0xE0 | (cp >> 12));
        t[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F));
        sb_rawn(b, t, 3);
    } else {
        t[0] = (char)(0xF0 | (cp >> 18));
        t[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[3] = (char)(0x80 | (cp & 0x3F));
        sb_rawn(b, t, 4);
    }
}

static int hex4(parser *ps, unsigned *out) {
    if (ps->end - ps->p < 4) return fail(ps, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = ps->p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return fail(ps, "invalid \\u escape");
    }
    ps->p += 4;
    *out = v;
    return 0;
}

static int parse_string(parser *ps, char **out, size_t *outlen) {
    sbuf b;
    sb_init(&b);
    ps->p++; /* opening quote */
    while (1) {
        if (ps->p >= ps->end) {
            sb_free(&b);
            return fail(ps, "unterminated string");
        }
        unsigned char c = (unsigned char)*ps->p;
        if (c == '"') {
            ps->p++;
            break;
        }
        if (c < 0x20) {
            sb_free(&b);
            return fail(ps, "invalid control character in string");
        }
        if (c != '\\') {
            sb_rawn(&b, ps->p, 1);
            ps->p++;
            continue;
        }
        ps->p++;
        if (ps->p >= ps->end) {
            sb_free(&b);
            return fail(ps, "unterminated string");
        }
        char e = *ps->p++;
        switch (e) {
        case '"': sb_raw(&b, "\""); break;
        case '\\': sb_raw(&b, "\\"); break;
        case '/': sb_raw(&b, "/"); break;
        case 'b': sb_raw(&b, "\b"); break;
        case 'f': sb_raw(&b, "\f"); break;
        case 'n': sb_raw(&b, "\n"); break;
        case 'r': sb_raw(&b, "\r"); break;
        case 't': sb_raw(&b, "\t"); break;
        case 'u': {
            unsigned cp;
            if (hex4(ps, &cp) < 0) {
                sb_free(&b);
                return -1;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF && ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u') {
                const char *save = ps->p;
                unsigned lo;
                ps->p += 2;
                if (hex4(ps, &lo) == 0 && lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else {
                    ps->p = save;
                }
            }
            if (cp == 0) {
                sb_rawn(&b, "\0", 1);
            } else {
                put_utf8(&b, cp);
            }
            break;
        }
        default:
            sb_free(&b);
            return fail(ps, "invalid escape in string");
        }
    }
    if (b.oom) {
        sb_free(&b);
        return fail(ps, "out of memory");
    }
    if (!b.p) {
        b.p = calloc(1, 1);
        if (!b.p) return fail(ps, "out of memory");
    }
    *out = b.p;
    *outlen = b.len;
    return 0;
}

static int parse_number(parser *ps, jval *v) {
    const char *s = ps->p;
    int is_int = 1;
    if (ps->p < ps->end && *ps->p == '-') ps->p++;
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') return fail(ps, "invalid number");
    if (*ps->p == '0') {
        ps->p++;
    } else {
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') ps->p++;
    }
    if (ps->p < ps->end && *ps->p == '.') {
        is_int = 0;
        ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') return fail(ps, "invalid number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
        is_int = 0;
        ps->p++;
        if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-')) ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') return fail(ps, "invalid number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') ps->p++;
    }
    char tmp[64];
    size_t n = (size_t)(ps->p - s);
    if (n >= sizeof tmp) {
        /* Far longer than any number the protocol uses: keep it as a non-integer. */
        v->t = J_NUM;
        v->num = is_int ? 1e300 : 0;
        v->is_int = 0;
        return 0;
    }
    memcpy(tmp, s, n);
    tmp[n] = 0;
    v->t = J_NUM;
    v->num = strtod(tmp, NULL);
    if (is_int) {
        char *endp;
        errno = 0;
        long long i = strtoll(tmp, &endp, 10);
        if (errno == 0 && *endp == 0) {
            v->is_int = 1;
            v->i = i;
        }
    }
    return 0;
}

static int grow(jval *v, size_t *cap, int with_keys) {
    if (v->n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 4;
    jval *items = realloc(v->items, nc * sizeof *items);
    if (!items) return -1;
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, nc * sizeof *keys);
        if (!keys) return -1;
        v->keys = keys;
    }
    *cap = nc;
    return 0;
}

static int parse_array(parser *ps, jval *v) {
    size_t cap = 0;
    v->t = J_ARR;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
        return 0;
    }
    while (1) {
        if (grow(v, &cap, 0) < 0) return fail(ps, "out of memory");
        memset(&v->items[v->n], 0, sizeof(jval));
        if (parse_value(ps, &v->items[v->n]) < 0) return -1;
        v->n++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == ']') {
            ps->p++;
            return 0;
        }
        return fail(ps, "expected ',' or ']'");
    }
}

static int parse_object(parser *ps, jval *v) {
    size_t cap = 0;
    v->t = J_OBJ;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
        return 0;
    }
    while (1) {
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"') return fail(ps, "expected a property name in double quotes");
        if (grow(v, &cap, 1) < 0) return fail(ps, "out of memory");
        size_t klen;
        char *key;
        if (parse_string(ps, &key, &klen) < 0) return -1;
        v->keys[v->n] = key;
        memset(&v->items[v->n], 0, sizeof(jval));
        v->n++; /* owned from here on, freed by json_free even if the value fails */
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') return fail(ps, "expected ':'");
        ps->p++;
        if (parse_value(ps, &v->items[v->n - 1]) < 0) return -1;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == '}') {
            ps->p++;
            return 0;
        }
        return fail(ps, "expected ',' or '}'");
    }
}

static int lit(parser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return fail(ps, "invalid literal");
    ps->p += n;
    return 0;
}

static int parse_value(parser *ps, jval *v) {
    skip_ws(ps);
    if (ps->p >= ps->end) return fail(ps, "expecting value");
    if (++ps->depth > MAX_DEPTH) return fail(ps, "nested too deeply");
    int rc;
    switch (*ps->p) {
    case '{': rc = parse_object(ps, v); break;
    case '[': rc = parse_array(ps, v); break;
    case '"':
        v->t = J_STR;
        rc = parse_string(ps, &v->s, &v->slen);
        break;
    case 't': v->t = J_BOOL; v->b = 1; rc = lit(ps, "true"); break;
    case 'f': v->t = J_BOOL; v->b = 0; rc = lit(ps, "false"); break;
    case 'n': v->t = J_NULL; rc = lit(ps, "null"); break;
    default: rc = parse_number(ps, v); break;
    }
    ps->depth--;
    return rc;
}

int json_parse(const char *buf, size_t len, jval *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (err && errlen) err[0] = 0;
    parser ps = {buf, buf + len, err, errlen, 0};
    if (!valid_utf8((const unsigned char *)buf, len)) {
        return fail(&ps, "not valid UTF-8");
    }
    if (parse_value(&ps, out) < 0) {
        json_free(out);
        return -1;
    }
    skip_ws(&ps);
    if (ps.p != ps.end) {
        json_free(out);
        return fail(&ps, "extra data after the value");
    }
    return 0;
}

void json_free(jval *v) {
    if (!v) return;
    if (v->t == J_STR) free(v->s);
    if (v->t == J_ARR || v->t == J_OBJ) {
        for (size_t i = 0; i < v->n; i++) {
            json_free(&v->items[i]);
            if (v->keys) free(v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    memset(v, 0, sizeof *v);
}

const jval *json_get(const jval *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    const jval *found = NULL;
    for (size_t i = 0; i < obj->n; i++) {
        if (strcmp(obj->keys[i], key) == 0) found = &obj->items[i];
    }
    return found;
}

/* ---- writer ------------------------------------------------------------------------------ */
void sb_init(sbuf *b) { memset(b, 0, sizeof *b); }

void sb_free(sbuf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

void sb_rawn(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void sb_raw(sbuf *b, const char *s) { sb_rawn(b, s, strlen(s)); }

void sb_printf(sbuf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        sb_rawn(b, small, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_rawn(b, big, (size_t)n);
    free(big);
}

static void sb_strn(sbuf *b, const char *s, size_t n) {
    sb_raw(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': sb_raw(b, "\\\""); break;
        case '\\': sb_raw(b, "\\\\"); break;
        case '\n': sb_raw(b, "\\n"); break;
        case '\r': sb_raw(b, "\\r"); break;
        case '\t': sb_raw(b, "\\t"); break;
        default:
            if (c < 0x20) {
                sb_printf(b, "\\u%04x", c);
            } else {
                sb_rawn(b, (const char *)&s[i], 1);
            }
        }
    }
    sb_raw(b, "\"");
}

void sb_str(sbuf *b, const char *s) {
    if (!s) {
        sb_raw(b, "null");
        return;
    }
    sb_strn(b, s, strlen(s));
}

void sb_key(sbuf *b, const char *k) {
    if (b->len && b->p[b->len - 1] != '{') sb_raw(b, ",");
    sb_str(b, k);
    sb_raw(b, ":");
}

void sb_num(sbuf *b, double v) {
    if (!isfinite(v)) {
        sb_raw(b, "null");
        return;
    }
    if (v == (double)(long long)v && fabs(v) < 1e15) {
        sb_printf(b, "%lld.0", (long long)v);
        return;
    }
    /* Shortest form that reads back the same, as Python's repr does. */
    char t[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(t, sizeof t, "%.*g", prec, v);
        if (strtod(t, NULL) == v) break;
    }
    sb_raw(b, t);
}

void sb_json(sbuf *b, const jval *v) {
    switch (v->t) {
    case J_NULL: sb_raw(b, "null"); break;
    case J_BOOL: sb_raw(b, v->b ? "true" : "false"); break;
    case J_NUM:
        if (v->is_int) sb_printf(b, "%lld", v->i);
        else sb_num(b, v->num);
        break;
    case J_STR: sb_strn(b, v->s, v->slen); break;
    case J_ARR:
        sb_raw(b, "[");
        for (size_t i = 0; i < v->n; i++) {
            if (i) sb_raw(b, ",");
            sb_json(b, &v->items[i]);
        }
        sb_raw(b, "]");
        break;
    case J_OBJ:
        sb_raw(b, "{");
        for (size_t i = 0; i < v->n; i++) {
            if (i) sb_raw(b, ",");
            sb_str(b, v->keys[i]);
            sb_raw(b, ":");
            sb_json(b, &v->items[i]);
        }
        sb_raw(b, "}");
        break;
    }
}
