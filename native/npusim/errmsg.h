/* How a simulator library leaves the text of a failure where aclGetRecentErrMsg finds it: in the
 * error manager (liberror_manager.so, error_manager.cc), through the C entry point real CANN
 * libraries use, ReportInnerErrMsgForC (runtime src/dfx/error_manager/error_manager.h). The text is
 * per thread, as the real manager keeps it per context. Not a public header of the fake tree. */
#ifndef NPUSIM_ERRMSG_H
#define NPUSIM_ERRMSG_H
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

int32_t ReportInnerErrMsgForC(const char *file_name, const char *func, uint32_t line, const char *error_code,
                              const char *format, ...) __attribute__((format(printf, 5, 6)));

/* The thread's last failing code in this library, for aclrtPeekAtLastError / aclrtGetLastError:
 * weak and hidden, so the sources of one library share one. */
__attribute__((weak, visibility("hidden"))) __thread int32_t npusim_last_code;

__attribute__((format(printf, 4, 5), unused)) static void npusim_report(int32_t code, const char *error_id,
                                                                       const char *func, const char *fmt, ...) {
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    npusim_last_code = code;
    ReportInnerErrMsgForC(__FILE__, func, 0, error_id, "%s (error code %d)", text, (int)code);
}
#endif
