// The calling convention of the project's C++ kernels (fms_paged/native builds them with this
// folder on the include path). A kernel takes one struct of arguments, declared from one list of
// (type, name) fields (kernels/kernels.h), and exports a function that spells the struct's layout: its
// name, its size, and every field's name, kind and offset. The operators that call a kernel
// (ops/ops.cpp) declare the struct from the same list and refuse a library whose layout is not
// theirs, so a field cannot be read at the wrong offset or with the wrong type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

// the half-precision storage types a kernel may read and write (as torch.bfloat16 and
// torch.float16 store them): distinct types, so a bf16 pointer cannot pass for an fp16 one
struct fms_bf16 {
  uint16_t bits;
};
struct fms_f16 {
  uint16_t bits;
};

// a field's kind in the layout string: i8, i32, i64, f32, bf16, f16, or a pointer's pointee kind
// followed by *
template <class T>
std::string fms_paged_kind() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) return fms_paged_kind<std::remove_pointer_t<U>>() + "*";
  else if constexpr (std::is_same_v<U, int8_t>) return "i8";
  else if constexpr (std::is_same_v<U, int32_t>) return "i32";
  else if constexpr (std::is_same_v<U, int64_t>) return "i64";
  else if constexpr (std::is_same_v<U, fms_bf16>) return "bf16";
  else if constexpr (std::is_same_v<U, fms_f16>) return "f16";
  else {
    static_assert(std::is_same_v<U, float>, "a field of another type: give it a kind here and in fms_paged/native");
    return "f32";
  }
}

#define FMS_PAGED_FIELD_DECL(type, name) type name;
#define FMS_PAGED_FIELD_LAYOUT(type, name) \
  s += std::string(" ") + #name + ":" + fms_paged_kind<type>() + "@" + std::to_string(offsetof(Self, name));

// "Name <sizeof>: <name>:<kind>@<offset> ...", the layout of struct Struct declared from FIELDS
#define FMS_PAGED_LAYOUT_OF(Struct, Name, FIELDS)                                 \
  [] {                                                                            \
    using Self = Struct;                                                          \
    std::string s = std::string(Name) + " " + std::to_string(sizeof(Self)) + ":"; \
    FIELDS(FMS_PAGED_FIELD_LAYOUT)                                                \
    return s;                                                                     \
  }()

// struct Struct { FIELDS }; and const char* layout_fn() returning its layout (inside extern "C")
#define FMS_PAGED_ARGS(Struct, FIELDS, layout_fn)                                        \
  struct Struct {                                                                        \
    FIELDS(FMS_PAGED_FIELD_DECL)                                                         \
  };                                                                                     \
  const char* layout_fn() {                                                              \
    static const std::string layout = FMS_PAGED_LAYOUT_OF(Struct, #Struct, FIELDS);      \
    return layout.c_str();                                                               \
  }
