/* Stand-in; see stddef.h. */
#pragma once
#define bool _Bool
#define true 1
#define false 0
