// The console's pages and assets, built into the binary (server/web/assets, and dygraphs from
// Debian's libjs-dygraphs; embed_assets.cmake writes their bytes at build time).
#ifndef TRAINYARD_SERVER_WEB_WEB_ASSETS_H_
#define TRAINYARD_SERVER_WEB_WEB_ASSETS_H_

#include <cstddef>

namespace trainyard::web {

struct WebAsset {
  const char* path;          // "/assets/app.js"
  const char* content_type;  // "application/javascript" (text is UTF-8)
  const unsigned char* data;
  size_t size;
};

extern const WebAsset kWebAssets[];
extern const size_t kWebAssetCount;

}  // namespace trainyard::web

#endif  // TRAINYARD_SERVER_WEB_WEB_ASSETS_H_
