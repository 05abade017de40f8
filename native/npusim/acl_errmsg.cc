/* aclGetRecentErrMsg of the ACL front-ends: what the error manager holds for this thread
 * (runtime src/acl/aclrt_impl/acl.cpp, aclGetRecentErrMsgImpl: the host messages of
 * error_message::GetErrMgrErrorMessage; the device has no separate fault log here). NULL when
 * nothing failed since the last read, as the real one; the text stays valid until this thread's
 * next call. */
#include <memory>
#include <string>

namespace error_message {
std::unique_ptr<const char[]> GetErrMgrErrorMessage();
}

extern "C" __attribute__((visibility("default"))) const char *aclGetRecentErrMsg() {
    static thread_local std::string recent;
    std::unique_ptr<const char[]> msg = error_message::GetErrMgrErrorMessage();
    if (!msg) return nullptr;
    recent.assign(msg.get());
    return recent.c_str();
}
