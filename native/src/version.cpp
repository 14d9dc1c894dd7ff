#include "tnt/version.hpp"
namespace tnt {
const char* version() { return "0.1.0"; }
}
