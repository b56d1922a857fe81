/*
 * errors.c -- the thread-local "last error" buffer behind fp8ops_set_error /
 * fp8ops_last_error (the inner C layer returns codes; ops.c raises).
 */
#include <stdarg.h>
#include <stdio.h>

#include "fp8ops.h"

static _Thread_local char g_last_error[1024];

const char* fp8ops_last_error(void) { return g_last_error; }

int fp8ops_set_error(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
  va_end(ap);
  return code;
}
