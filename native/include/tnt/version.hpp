#pragma once
namespace tnt {
const char* version();
}
