/* liberror_manager.so of the simulated CANN tree: the error manager every CANN library reports its
 * failures to, and aclGetRecentErrMsg reads. Two of the real library's entry points
 * (runtime src/dfx/error_manager/error_manager.h and pkg_inc/base/err_mgr.h):
 *   ReportInnerErrMsgForC(file, func, line, error_code, format, ...)   the C entry point
 *   error_message::GetErrMgrErrorMessage()                              what was reported, then clear
 * Messages are kept per thread (the real manager's default INTERNAL_MODE keeps them per context,
 * and a context is used by one thread at a time in torch_npu), joined by newlines in report order,
 * each "<error_code>: <text>". Built with a version script, so it exports these two names only. */
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace {
thread_local std::string g_messages;
}

namespace error_message {
using unique_const_char_array = std::unique_ptr<const char[]>;

__attribute__((visibility("default"))) unique_const_char_array GetErrMgrErrorMessage() {
    if (g_messages.empty()) return nullptr;
    char *out = new char[g_messages.size() + 1];
    std::memcpy(out, g_messages.c_str(), g_messages.size() + 1);
    g_messages.clear();
    return unique_const_char_array(out);
}
}  // namespace error_message

extern "C" __attribute__((visibility("default"))) int32_t ReportInnerErrMsgForC(const char *file_name, const char *func, uint32_t line,
                                         const char *error_code, const char *format, ...) {
    if (!file_name || !func || !error_code || !format) return -1;  // as the real one checks
    (void)line;
    char text[1024];
    va_list ap;
    va_start(ap, format);
    std::vsnprintf(text, sizeof text, format, ap);
    va_end(ap);
    if (!g_messages.empty()) g_messages += '\n';
    g_messages += error_code;
    g_messages += ": ";
    g_messages += text;
    // A thread that fails in a loop and never reads would grow without bound: keep the newest.
    if (g_messages.size() > (64u << 10)) g_messages.erase(0, g_messages.size() - (32u << 10));
    return 0;
}
