#pragma once
// The engine's side of the C table in tnt/c_api.h (c_api.cpp): what the Python module tells it,
// and the error codes both bindings report by.
#include <memory>
#include <string>

#include "tnt/c_api.h"
#include "tnt/engine.hpp"
#include "tnt/errors.hpp"

namespace tnt {

// The kind of a core exception as a TNT_* code of tnt/c_api.h.
int error_code(const CollectiveError& e);

// The engine that the table reduces on from now on: the latest started, for as long as Python
// holds it.
void set_c_api_engine(const std::shared_ptr<Engine>& engine);

// The Python exception class that the rank API raises for `code`: the table's error messages
// start with its name, which tnt_notebook.keras.allreduce_op re-raises.
void set_c_api_error_name(int code, const std::string& name);

// The table, for tnt_notebook._native.c_api().
const tnt_c_api* c_api_table();

}  // namespace tnt
