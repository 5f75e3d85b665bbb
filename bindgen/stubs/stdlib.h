/* Stand-in; see stddef.h. */
#pragma once
