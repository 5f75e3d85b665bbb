/* Stand-in; see stddef.h. va_list is opaque to cffi: functions taking it are dropped. */
#pragma once
typedef struct __clickpaca_va_list * va_list;
