%% A stand-in for the telemetry library, for convoy_SUITE: convoy calls
%% telemetry:execute/3 only when this module is loaded; events go to the process
%% registered as telemetry_sink, if any.
-module(telemetry).
-export([execute/3]).

execute(Event, Measurements, Metadata) ->
    case whereis(telemetry_sink) of
        undefined -> ok;
        Pid -> Pid ! {telemetry, Event, Measurements, Metadata}, ok
    end.
