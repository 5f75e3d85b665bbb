/* Stand-in for the C library header: declares only what llama.h / ggml.h use.
   bindgen drops every declaration from this folder; cffi knows these types. */
#pragma once
typedef unsigned long size_t;
typedef long ptrdiff_t;
#define NULL ((void*)0)
#define offsetof(t, m) 0
