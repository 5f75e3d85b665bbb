/* Stand-in; see stddef.h. */
#pragma once
#include <stddef.h>
typedef struct _IO_FILE FILE;
